"""Attention: the layer models use, the per-step metadata, and the ops behind it."""

from extkv.attention.layer import Attention
from extkv.attention.metadata import (
    AttentionMetadata,
    ForwardContext,
    MambaMetadata,
    get_forward_context,
    set_forward_context,
)
from extkv.attention.mla import MLAAttention

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ForwardContext",
    "MLAAttention",
    "MambaMetadata",
    "get_forward_context",
    "set_forward_context",
]
