"""Tensor-parallel process-group state: which rank this process is, and the collectives;
the heartbeats that tell a hung worker from a busy one."""

from extkv.distributed.group import (
    SINGLE,
    CommunicationError,
    TPGroup,
    connect,
    current_group,
    use_group,
)
from extkv.distributed.heartbeat import HeartbeatMonitor, beat_interval, start_beating

__all__ = [
    "SINGLE",
    "CommunicationError",
    "HeartbeatMonitor",
    "TPGroup",
    "beat_interval",
    "connect",
    "current_group",
    "start_beating",
    "use_group",
]
