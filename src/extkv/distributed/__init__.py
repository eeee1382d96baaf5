"""Tensor-parallel process-group state: which rank this process is, and the collectives."""

from extkv.distributed.group import (
    SINGLE,
    CommunicationError,
    TPGroup,
    connect,
    current_group,
    use_group,
)

__all__ = ["SINGLE", "CommunicationError", "TPGroup", "connect", "current_group", "use_group"]
