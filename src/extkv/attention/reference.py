"""Plain torch attention over the paged cache: the CPU path and the kernels' oracle.

One sequence at a time, its K/V gathered through the block table. A whole
prompt is one causal `scaled_dot_product_attention` call, as transformers makes
it (the CPU's flash kernel: memory linear in the prompt); a prompt after a
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


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int = QUERY_CHUNK
) -> torch.Tensor:
    """Causal attention of q (L, Hq, D) over k/v (S, Hkv, D), q being the last L of S, in
    fp32, with memory O(chunk x S) beyond the inputs. The tensors go to SDPA as
    (1, H, L, D): in 3-D, the CPU takes its math path, which builds the whole L x S scores."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of queries; got {chunk}")
    q_len, kv_len = q.shape[0], k.shape[0]
    offset = kv_len - q_len  # the cached prefix before the first query
    q, k, v = (t.transpose(0, 1).float()[None] for t in (q, k, v))
    attend = functools.partial(F.scaled_dot_product_attention, scale=scale, enable_gqa=True)
    if offset == 0 or q_len == 1:
        # A whole prompt: transformers' own call (no mask to build); one query: no mask.
        out = attend(q, k, v, is_causal=q_len > 1)
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
    """Causal attention within each sequence of a packed batch, no cache involved."""
    out = torch.empty_like(query)
    cu = cu_seqlens.tolist()
    for start, end in itertools.pairwise(cu):
        out[start:end] = causal_attention(query[start:end], key[start:end], value[start:end], scale)
    return out
