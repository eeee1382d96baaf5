"""Plain torch attention over the paged cache: the CPU path and the kernels' oracle.

A prefill goes one sequence at a time, its K/V gathered through the block table (the
profiling run's packed batch: its sequences of one length at once); a decode step's
sequences attend together, their contexts padded to the longest. A whole prompt is one
causal `scaled_dot_product_attention` call, as transformers makes it (the CPU's
flash kernel: memory linear in the prompt). A prompt after a cached prefix (a long
prompt's later chunks) is, on the CPU, two flash calls merged by their log-sum-exp:
every query against the whole prefix, and the new tokens among themselves under
the causal mask the kernel skips blocks of; elsewhere (the GPU kernels' oracle) it
goes `QUERY_CHUNK` queries at a time under a (chunk, context) mask. Either way its
memory grows linearly with its length, not with its square. A prompt with images whose
tokens see each other (key bounds: Gemma 3) takes the masked path, its mask reaching
to each query's bound.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from extkv.attention.metadata import AttentionMetadata


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write row `t` of `rows` (T, ...) to slot `slot_mapping[t]` of a paged cache
    (num_blocks, block_size, ...); -1 skips it (a decode batch's padding rows: a prefill
    has none, and its rows are not copied to drop them)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    block_size = cache.shape[1]
    cache[slot_mapping // block_size, slot_mapping % block_size] = rows.to(cache.dtype)


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token `t` of key/value (T, H, D) to slot `slot_mapping[t]`; -1 skips it."""
    store_rows(key, k_cache, slot_mapping)
    store_rows(value, v_cache, slot_mapping)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, first_block: int = 0
) -> torch.Tensor:
    """The token rows of a sequence's first `context_len` tokens in a paged cache
    (num_blocks, block_size, ...), through its block table row, from block `first_block`
    on (the blocks before it may be released: a sliding window)."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    rows = cache[block_table[first_block:num_blocks].long()].flatten(0, 1)
    return rows[: context_len - first_block * block_size]


# Queries per masked scaled_dot_product_attention call (a prompt continuing a cached
# prefix, off the CPU): its mask is QUERY_CHUNK x context.
QUERY_CHUNK = 1024


def whole_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of B prompts of one length, q (B, L, Hq, D) and k/v (B, L, Hkv, D),
    in fp32: transformers' own call (causal, no mask to build, GQA), on the CPU's flash
    kernel. The tensors go to SDPA as (B, H, L, D): in 3-D, the CPU takes its math path,
    which builds the whole L x L scores."""
    q, k, v = (_heads_first(t) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def _heads_first(rows: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) rows as the fp32 (B, H, L, D) tensor SDPA takes, each head's rows
    contiguous: the CPU's flash kernel reads its K/V blocks 7-10% faster so than as token
    rows (2000-8000 tokens). Free for q and k (rotated into that layout); a copy else."""
    return rows.transpose(1, 2).float().contiguous()


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q (L, Hq, D) over k/v (S, Hkv, D), q being the last L of S, in
    fp32, with memory linear in L and S beyond the inputs. With `sliding_window` W, the
    query at position p sees the keys of positions p - W + 1 to p (transformers' mask)."""
    q_len, kv_len = q.shape[0], k.shape[0]
    offset = kv_len - q_len  # the cached prefix before the first query
    if sliding_window is not None and kv_len > sliding_window:
        return masked_chunk_attention(q, k, v, scale, sliding_window=sliding_window)
    if offset == 0:
        return whole_prompts(q[None], k[None], v[None], scale)[0]
    if q_len == 1:  # one query sees every key: nothing to mask
        q, k, v = (t.transpose(0, 1).float()[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    if q.device.type == "cpu":
        return _after_prefix_cpu(q, k[:offset], v[:offset], k[offset:], v[offset:], scale)
    return masked_chunk_attention(q, k, v, scale)


def prompt_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`causal_attention` of q (L, Hq, D) over a cached prefix's K/V and the L new tokens'
    own, given apart: a whole prompt (no prefix) and the CPU's split after a prefix use
    them as they are, so the new rows are never joined to the prefix (nor read back from
    the cache they were just written to)."""
    if prefix_k.shape[0] == 0:
        return causal_attention(q, new_k, new_v, scale, sliding_window)
    within_window = sliding_window is None or prefix_k.shape[0] + len(q) <= sliding_window
    if q.device.type == "cpu" and within_window:
        return _after_prefix_cpu(q, prefix_k, prefix_v, new_k, new_v, scale)
    k, v = torch.cat((prefix_k, new_k)), torch.cat((prefix_v, new_v))
    return causal_attention(q, k, v, scale, sliding_window)


def _after_prefix_cpu(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The prefix part and the causal part of a prompt after a cached prefix, as two calls
    of the CPU's flash kernel (the one SDPA takes, here for its log-sum-exp), weighed by
    their softmax mass in one pass: the causal cost of one whole-prompt call, where one
    masked call would compute (and mask) every score of the new tokens' square (1.5x
    slower at 8192 tokens). Both give the kernel the K/V heads as they are: it maps the
    query heads onto them itself, as SDPA's `enable_gqa`."""
    q, prefix_k, prefix_v, new_k, new_v = (
        _heads_first(t[None]) for t in (q, prefix_k, prefix_v, new_k, new_v)
    )
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    prefix_out, prefix_lse = flash(q, prefix_k, prefix_v, scale=scale)
    new_out, new_lse = flash(q, new_k, new_v, is_causal=True, scale=scale)
    prefix_share = torch.sigmoid(prefix_lse - new_lse)[..., None]  # its softmax mass
    return torch.lerp(new_out, prefix_out, prefix_share)[0].transpose(0, 1)


def masked_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    chunk: int = QUERY_CHUNK,
    sliding_window: int | None = None,
    key_bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_attention` on any device, `chunk` queries at a time, each against the keys
    its queries see under a mask: memory O(chunk x S), O(chunk x (chunk + W)) with a
    sliding window W. `key_bounds` (L,): the last key (an index into k) each query sees,
    where it is not the query's own (image tokens that see their whole image)."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of queries; got {chunk}")
    q_len, kv_len = q.shape[0], k.shape[0]
    offset = kv_len - q_len
    window = sliding_window or kv_len
    q, k, v = (t.transpose(0, 1).float()[None] for t in (q, k, v))
    out = torch.empty_like(q)
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        first = max(0, offset + start - window + 1)  # the first key the chunk's first query sees
        query_pos = torch.arange(offset + start, offset + end, device=q.device)[:, None]
        bound = query_pos if key_bounds is None else key_bounds[start:end, None].to(q.device)
        last = int(bound.max()) + 1  # past the last key a query of the chunk sees
        key_pos = torch.arange(first, last, device=q.device)
        mask = (key_pos <= bound) & (key_pos > query_pos - window)
        out[:, :, start:end] = F.scaled_dot_product_attention(
            q[:, :, start:end],
            k[:, :, first:last],
            v[:, :, first:last],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
    return out[0].transpose(0, 1)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query (T, Hq, D) against each sequence's cached context (its last `sliding_window`
    tokens per query, with a window; up to `metadata.key_bounds` where given); returns
    (T, Hq, D). `new_kv`: the step's key and value rows (T, Hkv, D) as written to the
    cache, where the caller has them: a prefill then reads back only the cached prefixes."""
    if metadata.max_seqlen_q == 1:
        return _decode(query, k_cache, v_cache, metadata, scale, sliding_window)
    cu = metadata.cu_seqlens_q.tolist()
    outs = []
    for s, context_len in enumerate(metadata.context_lens.tolist()):
        rows = slice(cu[s], cu[s + 1])
        new = None if new_kv is None else (new_kv[0][rows], new_kv[1][rows])
        table = metadata.block_tables[s]
        bounds = _image_bounds(metadata.key_bounds, rows, context_len)
        outs.append(
            _prefill_one(
                query[rows],
                k_cache,
                v_cache,
                table,
                context_len,
                scale,
                sliding_window,
                new,
                bounds,
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(query.dtype).contiguous()


def _image_bounds(
    key_bounds: torch.Tensor | None, rows: slice, context_len: int
) -> torch.Tensor | None:
    """One sequence's key bounds where some token's reaches past itself (an image whose
    tokens see each other); None where all are causal."""
    if key_bounds is None:
        return None
    bounds = key_bounds[rows].long()
    own = torch.arange(context_len - len(bounds), context_len, device=bounds.device)
    return bounds if bool((bounds != own).any()) else None


def _prefill_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    sliding_window: int | None,
    new: tuple[torch.Tensor, torch.Tensor] | None,
    key_bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's new tokens q (L, Hq, D) against its context: from the cache, or its
    cached prefix from the cache and the rest from `new` (its own K/V rows); queries with
    `key_bounds` (positions) under the mask they make."""
    # From the block of the first key the first query sees: the blocks before it, out of
    # every window, may be freed. Positions are relative, so the window is too.
    seen = 0 if sliding_window is None else context_len - len(q) - sliding_window + 1
    first_block = max(0, seen) // k_cache.shape[1]
    cached = context_len if new is None else context_len - len(q)
    k = gather_context(k_cache, block_table, cached, first_block)
    v = gather_context(v_cache, block_table, cached, first_block)
    if key_bounds is not None:
        if new is not None:
            k, v = torch.cat((k, new[0])), torch.cat((v, new[1]))
        bounds = key_bounds - first_block * k_cache.shape[1]
        return masked_chunk_attention(
            q, k, v, scale, sliding_window=sliding_window, key_bounds=bounds
        )
    if new is None:
        return causal_attention(q, k, v, scale, sliding_window)
    return prompt_attention(q, k, v, *new, scale, sliding_window)


# A decode's keys (and values) are gathered at most this many bytes at a time, each
# sequence's context padded to the batch's longest.
DECODE_GATHER_BYTES = 64 << 20


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query per sequence: the sequences attend together, their contexts gathered into
    (S, Hkv, L, D) padded to the longest under a padding (and window) mask, rather than
    one call each (a CPU decode step of 256 sequences made 256 calls per layer)."""
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # token rows
    lengths = metadata.context_lens.long()
    if not len(lengths):
        return out
    block_size = k_cache.shape[1]
    row_bytes = k_cache[0, 0].numel() * 4  # one token's keys in fp32
    per_call = max(1, DECODE_GATHER_BYTES // (row_bytes * int(lengths.max())))
    for start in range(0, len(lengths), per_call):
        rows = slice(start, start + per_call)
        seen = lengths[rows]
        width = int(seen.max())
        # Padding and released blocks (outside every window) read block 0, masked out.
        tables = metadata.block_tables[rows, : -(-width // block_size)].long().clamp(min=0)
        pos = torch.arange(width, device=query.device)
        visible = pos < seen[:, None]
        if sliding_window is not None:
            visible &= pos >= seen[:, None] - sliding_window
        k = _gathered(k_cache, tables, width, visible)
        v = k if v_cache is k_cache else _gathered(v_cache, tables, width, visible)
        q = query[rows].float()[:, :, None]  # (S, Hq, 1, D)
        mask = visible[:, None, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o[:, :, 0].to(out.dtype)
    return out


def _gathered(
    cache: torch.Tensor, tables: torch.Tensor, width: int, visible: torch.Tensor
) -> torch.Tensor:
    """(S, H, width, D) fp32 rows of each sequence's blocks; the hidden ones zeroed (they
    may hold anything, NaN included, and a masked NaN still spoils the sum)."""
    rows = cache[tables].flatten(1, 2)[:, :width].float()
    return rows.masked_fill(~visible[:, :, None, None], 0.0).transpose(1, 2)


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
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # token rows
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
