"""Attention ops, dispatched by device: Triton kernels on CUDA, torch reference on CPU."""

from __future__ import annotations

import torch

from extkv.attention.metadata import AttentionMetadata
from extkv.attention.reference import (
    paged_attention_reference,
    store_kv_reference,
    varlen_attention_reference,
)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.is_cuda:  # Triton is imported on the GPU path only: CPU installs may lack it
        from extkv.kernels.store_kv import store_kv as store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if query.is_cuda:
        from extkv.kernels.paged_attention import paged_attention as paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, metadata, scale)
    return paged_attention_reference(query, k_cache, v_cache, metadata, scale)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if query.is_cuda:
        from extkv.kernels.paged_attention import varlen_attention as varlen_attention_triton

        return varlen_attention_triton(query, key, value, cu_seqlens, scale)
    return varlen_attention_reference(query, key, value, cu_seqlens, scale)
