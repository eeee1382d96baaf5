"""The attention layer models use: prepare q/k/v, write new K/V into the paged cache, attend."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import nn

from extkv.attention.metadata import get_forward_context
from extkv.attention.ops import qk_norm_rope, rope_store_attention, varlen_attention


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k before rotary (Qwen3): the two (head_dim,) weights."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


class Attention(nn.Module):
    """Causal GQA attention over the paged KV cache of one layer, taking the fused qkv
    projection: one kernel norms and rotates q and k and writes k and v to the cache.

    `k_cache` / `v_cache` are (num_blocks, block_size, num_kv_heads, head_dim)
    views of any stride, bound by the model runner once the KV cache exists;
    the kernels read them through strides, so every layout works unchanged.
    Before binding (the profiling run) attention runs on the step's own K/V, window
    or not (only its memory counts there).
    """

    latent_cache: ClassVar[bool] = False  # K and V per head (MLA keeps one latent instead)

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # each query sees its last this many tokens
        self.kv_group = 0  # the step's attention metadata this layer reads (its KV cache group)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """qkv (T, (num_heads + 2 num_kv_heads) * head_dim), positions (T,), the rotary
        table (max_position, rotary_dim) -> (T, num_heads * head_dim)."""
        metadata = get_forward_context().attention[self.kv_group]
        q_weight, k_weight, eps = qk_norm or (None, None, 0.0)
        prepare = (qkv, positions, cos_sin_cache, self.num_heads, self.num_kv_heads)
        if self.k_cache.numel() == 0:
            q, k, v = qk_norm_rope(*prepare, q_weight, k_weight, eps)
            out = varlen_attention(
                q, k, v, metadata.cu_seqlens_q, metadata.max_seqlen_q, self.scale
            )
        else:
            cache = (self.k_cache, self.v_cache)
            out = rope_store_attention(
                *prepare, q_weight, k_weight, eps, *cache, metadata, self.scale, self.sliding_window
            )
        return out.view(-1, self.num_heads * self.head_dim)
