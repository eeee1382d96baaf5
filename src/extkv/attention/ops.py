"""Attention ops, dispatched by device: Triton kernels on CUDA, torch reference on CPU.

The q/k preparation (per-head norm, rotary, the KV cache write) has its torch
reference with the models' other fused ops, in extkv.models.reference; as
extkv.models imports this package, that module is imported at call time.
"""

from __future__ import annotations

import os

import torch

from extkv.attention.metadata import AttentionMetadata
from extkv.attention.reference import (
    paged_attention_reference,
    store_kv_reference,
    store_rows,
    varlen_attention_reference,
)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused qkv projection -> q, k, v per head, q and k normed and rotated."""
    if qkv.is_cuda:  # Triton is imported on the GPU path only: CPU installs may lack it
        from extkv.kernels.rotary import qk_norm_rope as impl
    else:
        from extkv.models.reference import qk_norm_rope as impl
    return impl(
        qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps
    )


def rope_store_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`qk_norm_rope`, k and v written to the paged cache at the step's slots (-1 skips),
    then `paged_attention` of q over that cache: on CUDA one kernel prepares and stores
    (and a prefill with nothing cached attends over its own K/V: `attends_own_kv`; a decode
    step of a few sequences does all of it in one kernel: `takes_decode_attention`).
    On the CPU the new K/V rows also go to the attention as computed, so a prefill reads
    back from the cache only the prefixes it continues (a whole prompt: nothing)."""
    prepare = (qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads)
    if qkv.is_cuda:
        cache = (k_cache, v_cache)
        if attends_own_kv(metadata, k_cache.shape[-1], qkv.dtype):
            from extkv.kernels.prefill_attention import rope_store_prefill_attention

            return rope_store_prefill_attention(
                *prepare, q_norm_weight, k_norm_weight, eps, *cache, metadata, scale, sliding_window
            )
        if takes_decode_attention(metadata, k_cache.shape[-1]):
            from extkv.kernels.decode_attention import rope_store_decode_attention

            return rope_store_decode_attention(
                *prepare, q_norm_weight, k_norm_weight, eps, *cache, metadata, scale, sliding_window
            )
        from extkv.kernels.rotary import qk_norm_rope_store

        q = qk_norm_rope_store(
            *prepare, q_norm_weight, k_norm_weight, eps, *cache, metadata.slot_mapping
        )
        return paged_attention(q, k_cache, v_cache, metadata, scale, sliding_window)
    q, k, v = qk_norm_rope(*prepare, q_norm_weight, k_norm_weight, eps)
    store_kv_reference(k, v, k_cache, v_cache, metadata.slot_mapping)
    return paged_attention_reference(
        q, k_cache, v_cache, metadata, scale, sliding_window, new_kv=(k, v)
    )


def prefill_attention_enabled() -> bool:
    """EXTKV_PREFILL_ATTENTION: whether a CUDA prefill with nothing cached attends over
    the step's own K/V (1, the default: extkv.kernels.prefill_attention), or (0) through
    the paged cache as every other step does. On the H200 the own-K/V kernel took a
    Qwen3-0.6B-shaped 8192-token prefill from 0.335 to 0.436 of bf16 peak (BENCHMARKS.md,
    2026-12-05, gpu-check prefill-own-kv measures both)."""
    wanted = os.environ.get("EXTKV_PREFILL_ATTENTION", "1")
    if wanted not in ("0", "1"):
        raise ValueError(
            "EXTKV_PREFILL_ATTENTION must be 0 (the paged kernel) or 1 (the step's own K/V "
            f"where nothing is cached), got {wanted!r}"
        )
    return wanted == "1"


# Where the one-kernel decode attention runs: batches of up to this many sequences, heads
# of up to this many channels. On an H100 (BENCHMARKS.md, 2026-12-05 session 7) it cut
# Qwen3-0.6B's layer (head dim 128) from 30.7 to 26.7 us at batch 1 and from 59.1 to 58.3
# at 16, and SmolLM2-135M's batch-1 step (64) from 0.625 to 0.549 ms; but it slowed
# Qwen3's batch 256 from 6.95 to 7.57 ms a step (enough sequences to fill the GPU leave
# no split to merge and no wait to hide, and its programs, at 165 registers, fit fewer to
# an SM than the paged kernel's) and Gemma3-1B's batch-1 step (256) from 1.556 to 1.601.
DECODE_ATTENTION_MAX_SEQS = 16
DECODE_ATTENTION_MAX_HEAD_DIM = 128


def takes_decode_attention(metadata: AttentionMetadata, head_dim: int) -> bool:
    """Whether a CUDA step's attention runs as one kernel (extkv.kernels.decode_attention):
    a decode step of at most DECODE_ATTENTION_MAX_SEQS sequences (graph padding included,
    so the choice is the shape's) with heads of at most DECODE_ATTENTION_MAX_HEAD_DIM,
    unless EXTKV_DECODE_ATTENTION=0."""
    small = metadata.num_seqs <= DECODE_ATTENTION_MAX_SEQS
    narrow = head_dim <= DECODE_ATTENTION_MAX_HEAD_DIM
    return not metadata.is_prefill and small and narrow and decode_attention_enabled()


def decode_attention_enabled() -> bool:
    """EXTKV_DECODE_ATTENTION: whether a CUDA decode step of a few sequences runs each
    attention layer as one kernel (1, the default: `takes_decode_attention`) or as three
    (0: q/k norm + rotary + KV store, the paged kernel, the merge of its splits)."""
    wanted = os.environ.get("EXTKV_DECODE_ATTENTION", "1")
    if wanted not in ("0", "1"):
        raise ValueError(
            f"EXTKV_DECODE_ATTENTION must be 0 (three kernels) or 1 (one kernel), got {wanted!r}"
        )
    return wanted == "1"


def attends_own_kv(metadata: AttentionMetadata, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a CUDA step's attention reads the step's own K/V rather than the cache: a
    prefill with no cached prefix and no image key bounds, in a shape the prefill kernel
    takes, unless EXTKV_PREFILL_ATTENTION=0. All of it known on the host (no sync); a
    sliding window is the kernel's too."""
    if not metadata.is_prefill or not prefill_attention_enabled():
        return False
    from extkv.kernels.prefill_attention import supports

    return metadata.no_cached_prefix and metadata.key_bounds is None and supports(head_dim, dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query (T, Hq, D) against each sequence's context in the paged cache (its last
    `sliding_window` tokens per query, with one): the Triton kernel on CUDA, the torch
    reference elsewhere."""
    if query.is_cuda:
        from extkv.kernels.paged_attention import paged_attention as paged_attention_triton

        return paged_attention_triton(
            query, k_cache, v_cache, metadata, scale, sliding_window=sliding_window
        )
    return paged_attention_reference(query, k_cache, v_cache, metadata, scale, sliding_window)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch (the longest `max_seqlen`
    tokens), no cache bound (the profiling run): on CUDA (unless EXTKV_PREFILL_ATTENTION=0)
    the prefill kernel the engine's prefills with nothing cached then run (so it is
    compiled at start-up), else (or for rows it does not take) the paged one; the torch
    reference elsewhere."""
    if query.is_cuda:
        from extkv.kernels import prefill_attention as prefill

        if prefill_attention_enabled() and prefill.supports(query.shape[-1], query.dtype):
            return prefill.prefill_attention(query, key, value, cu_seqlens, max_seqlen, scale)
        from extkv.kernels.paged_attention import varlen_attention as varlen_attention_triton

        return varlen_attention_triton(query, key, value, cu_seqlens, scale)
    return varlen_attention_reference(query, key, value, cu_seqlens, scale)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write latent (T, 1, D) into a paged MLA cache (num_blocks, block_size, 1, D) at
    slot_mapping (-1 skips): the K/V store kernel on CUDA (graph-safe; it writes the one
    row as both K and V, the same bytes twice), the torch reference elsewhere."""
    if latent.is_cuda:
        from extkv.kernels.store_kv import store_kv

        store_kv(latent, latent, cache, cache, slot_mapping)
    else:
        store_rows(latent, cache, slot_mapping)
