"""The attention layer models use: write new K/V into the paged cache, attend."""

from __future__ import annotations

import torch
from torch import nn

from extkv.attention.metadata import get_forward_context
from extkv.attention.ops import paged_attention, store_kv, varlen_attention


class Attention(nn.Module):
    """Causal GQA attention over the paged KV cache of one layer.

    `k_cache` / `v_cache` are (num_blocks, block_size, num_kv_heads, head_dim)
    views of any stride, bound by the model runner once the KV cache exists;
    the kernels read them through strides, so every layout works unchanged.
    Before binding (the profiling run) attention runs on the step's own K/V.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, num_heads * head_dim), k/v: (T, num_kv_heads * head_dim)."""
        metadata = get_forward_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() == 0:
            out = varlen_attention(q, k, v, metadata.cu_seqlens_q, self.scale)
        else:
            store_kv(k, v, self.k_cache, self.v_cache, metadata.slot_mapping)
            out = paged_attention(q, self.k_cache, self.v_cache, metadata, self.scale)
        return out.view(-1, self.num_heads * self.head_dim)
