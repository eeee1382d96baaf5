"""Plain torch attention over the paged cache: the CPU path and the kernels' oracle.

Written for clarity, not speed: one sequence at a time, K/V gathered through
the block table, `scaled_dot_product_attention` with the causal offset of the
cached prefix.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from extkv.attention.metadata import AttentionMetadata


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token `t` of key/value (T, H, D) to slot `slot_mapping[t]`; -1 skips it."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q (L, Hq, D) over k/v (S, Hkv, D), q being the last L of S."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
    mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).to(q.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query (T, Hq, D) against each sequence's cached context; returns (T, Hq, D)."""
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    cu = metadata.cu_seqlens_q.tolist()
    for s, context_len in enumerate(metadata.context_lens.tolist()):
        num_blocks = -(-context_len // block_size)
        blocks = metadata.block_tables[s, :num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:context_len]
        v = v_cache[blocks].flatten(0, 1)[:context_len]
        out[cu[s] : cu[s + 1]] = _attend(query[cu[s] : cu[s + 1]], k, v, scale)
    return out


def varlen_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch, no cache involved."""
    out = torch.empty_like(query)
    cu = cu_seqlens.tolist()
    for start, end in itertools.pairwise(cu):
        out[start:end] = _attend(query[start:end], key[start:end], value[start:end], scale)
    return out
