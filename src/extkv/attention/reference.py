"""Plain torch attention over the paged cache: the CPU path and the kernels' oracle.

One sequence at a time, its K/V gathered through the block table (the profiling
run's packed batch: its sequences of one length at once). A whole prompt is one
causal `scaled_dot_product_attention` call, as transformers makes it (the CPU's
flash kernel: memory linear in the prompt); a prompt after a
cached prefix goes `QUERY_CHUNK` queries at a time, each chunk against the keys
up to its last query under a (chunk, context) mask, so its memory grows linearly
with its length too, not with its square.
"""

from __future__ import annotations

import functools
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


# Queries per masked scaled_dot_product_attention call (a prompt continuing a cached
# prefix): its mask is QUERY_CHUNK x context. 1024 is about as fast as one call on the CPU.
QUERY_CHUNK = 1024


def whole_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of B prompts of one length, q (B, L, Hq, D) and k/v (B, L, Hkv, D),
    in fp32: transformers' own call (causal, no mask to build, GQA), on the CPU's flash
    kernel. The tensors go to SDPA as (B, H, L, D): in 3-D, the CPU takes its math path,
    which builds the whole L x L scores."""
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int = QUERY_CHUNK
) -> torch.Tensor:
    """Causal attention of q (L, Hq, D) over k/v (S, Hkv, D), q being the last L of S, in
    fp32, with memory O(chunk x S) beyond the inputs (4-D SDPA calls, as in whole_prompts)."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of queries; got {chunk}")
    q_len, kv_len = q.shape[0], k.shape[0]
    offset = kv_len - q_len  # the cached prefix before the first query
    if offset == 0:
        return whole_prompts(q[None], k[None], v[None], scale)[0]
    q, k, v = (t.transpose(0, 1).float()[None] for t in (q, k, v))
    attend = functools.partial(F.scaled_dot_product_attention, scale=scale, enable_gqa=True)
    if q_len == 1:
        out = attend(q, k, v)  # one query sees every key: nothing to mask
    else:
        out = torch.empty_like(q)
        for start in range(0, q_len, chunk):
            end = min(start + chunk, q_len)
            keys = offset + end  # what the chunk's last query sees
            key_pos = torch.arange(keys, device=q.device)
            mask = key_pos[None, :] <= key_pos[offset + start :, None]
            out[:, :, start:end] = attend(
                q[:, :, start:end], k[:, :, :keys], v[:, :, :keys], attn_mask=mask
            )
    return out[0].transpose(0, 1)


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
        out[cu[s] : cu[s + 1]] = causal_attention(query[cu[s] : cu[s + 1]], k, v, scale)
    return out


def varlen_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch, no cache involved. The
    sequences of one length go in one batched call: the profiling run's are 256 of one
    or two lengths, which one call each per layer would make slower than a long prompt."""
    out = torch.empty_like(query)
    starts: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        if end > start:
            starts.setdefault(end - start, []).append(start)
    for length, first in starts.items():
        offsets = torch.arange(length, device=query.device)
        rows = (torch.tensor(first, device=query.device)[:, None] + offsets).flatten()
        q, k, v = (t[rows].unflatten(0, (len(first), length)) for t in (query, key, value))
        out[rows] = whole_prompts(q, k, v, scale).flatten(0, 1).to(out.dtype)
    return out
