"""Causal paged attention in Triton: prefill (with a cached prefix) and decode.

One kernel serves both. A program owns one KV head of one sequence and a tile
of rows, each row a (query token, query head of that KV head's group) pair, so
every K/V tile read from the cache feeds all heads of the GQA group at once.
K/V rows are gathered through the block table and the cache's strides, which
is what lets one kernel read every layout.

Prefill tiles rows over the new tokens. Decode has one token per sequence, so
it tiles the *context* instead (split-K, "flash-decoding"): each split writes
a partial softmax and a small second kernel merges them. The split count comes
from tensor shapes only and each split's share of the context is computed on
the device, which keeps decode capturable in a CUDA graph. (Merging in the
attention kernel, by the last split to finish, measured no faster on the H200
at batch 1: BENCHMARKS.md, 2026-12-04 "fused decode"; it pays where the q/k norm,
rotary and KV store join it too: extkv.kernels.decode_attention.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from extkv.attention.metadata import AttentionMetadata
from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid

_LOG2E = math.log2(math.e)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    cu_seqlens_q_ptr,
    key_bounds_ptr,
    qk_scale,
    window,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UNMASKED_FIRST: tl.constexpr,
    KEY_BOUNDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (q_tiles * NUM_SPLITS, num_seqs, num_kv_heads); online softmax in fp32.
    UNMASKED_FIRST (a prefill without a window) runs the key tiles every query row
    sees without the mask: all but the diagonal ones. Decode keeps one masked loop,
    which measured faster there (two pipelined loops cost ~15% at batch 256).
    KEY_BOUNDS (a prefill with images whose tokens see each other): each query sees the
    keys up to its entry of `key_bounds` rather than its own position; the masked
    tiles then reach to the tile's furthest bound."""
    wait_for_previous_grid(USE_PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    q_tile = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_P2  # index among the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (token < q_len) & (rows % GROUP_P2 < GROUP)
    q_pos = context_len - q_len + token  # position in the context, for the causal mask
    q_last = q_pos  # the last key position each row sees
    if KEY_BOUNDS:
        q_last = tl.load(key_bounds_ptr + q_start + token, mask=row_ok, other=0)
    dim = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dim < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q_offs = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dim[None, :] * stride_qd, mask=io_mask, other=0.0)

    # This program's keys: its split's share of the context the tile's queries see (the
    # causal end; the window's start, `window` being the context's bound without one).
    kv_end = tl.minimum(context_len, context_len - q_len + (q_tile + 1) * BLOCK_Q)
    if KEY_BOUNDS:
        kv_end = tl.minimum(context_len, tl.maximum(kv_end, tl.max(q_last, 0) + 1))
    kv_begin = tl.maximum(context_len - q_len + q_tile * BLOCK_Q - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = kv_begin + split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt
    kv_masked_start = kv_lo
    if UNMASKED_FIRST:  # keys before the tile's first query: every row sees them
        first_q_pos = context_len - q_len + q_tile * BLOCK_Q
        unmasked = tl.maximum(tl.minimum(kv_hi, first_q_pos + 1) - kv_lo, 0)
        kv_masked_start = kv_lo + unmasked // BLOCK_N * BLOCK_N
    # Phase 0 (UNMASKED_FIRST only): the unmasked tiles; phase 1: the rest, masked.
    for phase in tl.static_range(0 if UNMASKED_FIRST else 1, 2):
        lo = kv_lo if phase == 0 else kv_masked_start
        hi = kv_masked_start if phase == 0 else kv_hi
        for start in range(lo, hi, BLOCK_N):
            row_max, row_sum, acc = attend_tile(
                q, q_pos, q_last, start, kv_hi, window, qk_scale, row_max, row_sum, acc,
                k_ptr, v_ptr, table_ptr, kv_head, dim, dim_ok,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                BLOCK_SIZE, BLOCK_N, DOT_PRECISION, phase == 1,
            )  # fmt: skip

    safe_sum = tl.where(row_sum > 0, row_sum, 1.0)  # 0 only where no key was visible
    o = acc / safe_sum[:, None]
    if NUM_SPLITS == 1:
        o_offs = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
        o_ptrs = out_ptr + o_offs + dim[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = ((q_start + token) * num_q_heads + head) * NUM_SPLITS + split
        lse = tl.where(row_sum > 0, row_max + tl.log2(safe_sum), float("-inf"))
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dim[None, :], o, mask=io_mask)
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def attend_tile(
    q,
    q_pos,
    q_last,
    start,
    kv_hi,
    window,
    qk_scale,
    row_max,
    row_sum,
    acc,
    k_ptr,
    v_ptr,
    table_ptr,
    kv_head,
    dim,
    dim_ok,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One online-softmax step over the BLOCK_N keys from `start`, gathered through the
    sequence's block table row; MASKED applies the causal (up to `q_last`) and window
    mask and the end of the range, which tiles wholly visible to every row do without."""
    kv_pos = start + tl.arange(0, BLOCK_N)
    kv_ok = kv_pos < kv_hi
    page = tl.load(table_ptr + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    offset = kv_pos % BLOCK_SIZE
    kv_mask = kv_ok[:, None] & dim_ok[None, :]
    k_offs = page[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh
    k = tl.load(k_ptr + k_offs + dim[None, :] * stride_kd, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (kv_pos[None, :] <= q_last[:, None]) & kv_ok[None, :]
        visible &= kv_pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    p, alpha, new_max, row_sum = softmax_step(s, row_max, row_sum, MASKED)
    v_offs = page[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
    v = tl.load(v_ptr + v_offs + dim[None, :] * stride_vd, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc


@triton.jit
def softmax_step(s, row_max, row_sum, MASKED: tl.constexpr):
    """The online softmax over one more tile of log2-scaled scores `s` (BLOCK_M, BLOCK_N):
    the tile's weights p, the factor the rows' earlier sums and outputs scale by, and the
    new row maxima and sums. MASKED: rows may have seen no key yet (a max of -inf), which
    exponentiate against 0."""
    new_max = tl.maximum(row_max, tl.max(s, 1))
    max_ref = tl.where(new_max == float("-inf"), 0.0, new_max) if MASKED else new_max
    p = tl.exp2(s - max_ref[:, None])
    alpha = tl.exp2(row_max - max_ref)
    return p, alpha, new_max, row_sum * alpha + tl.sum(p, 1)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (num_tokens, num_q_heads): weight each split's output by its softmax mass."""
    wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    part = (token * num_q_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dim = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dim < HEAD_DIM
    o = merged_splits(part_out_ptr, part_lse_ptr, part, dim, dim_ok, HEAD_DIM)
    o_ptrs = out_ptr + token * stride_ot + head * stride_oh + dim * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def merged_splits(part_out_ptr, part_lse_ptr, part, dim, dim_ok, HEAD_DIM: tl.constexpr):
    """One head's output from its splits' partial outputs and log2-sum-exps at rows
    `part`, each weighted by its softmax mass."""
    lse = tl.load(part_lse_ptr + part)
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    o_ptrs = part_out_ptr + part[:, None] * HEAD_DIM + dim[None, :]
    o = tl.load(o_ptrs, mask=dim_ok[None, :])
    total = tl.sum(weight, 0)
    return tl.sum(weight[:, None] * o, 0) / tl.where(total > 0, total, 1.0)


@dataclass(frozen=True)
class Tiles:
    """Launch shape of the attention kernel; `block_m` grows to fit a whole GQA group."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tuned on an H200, bf16, head_dim 128 (benchmarks/bench_attention.py --sweep, --prefill):
# prefill of 1 x 8192 tokens ~240 TFLOP/s (these tiles were 5% ahead of 64 x 64 x 4 warps);
# decode at batch 64 x 768 tokens reads K/V at ~4.0 TB/s (1.5x the copy bandwidth).
PREFILL_TILES = Tiles(block_m=128, block_n=32, num_warps=8, num_stages=2)
DECODE_TILES = Tiles(block_m=16, block_n=64, num_warps=4, num_stages=3)
MAX_SPLITS = 16
NO_WINDOW = 1 << 30  # the kernel's window without a sliding window: beyond any context
_INTERPRETED_SHARED_MEMORY = 232448  # an H200's per-program limit, for the CPU's choices


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _shared_memory(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETED_SHARED_MEMORY
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def fit_tiles(
    tiles: Tiles, block_m: int, head_dim_p2: int, itemsize: int, device: torch.device
) -> Tiles:
    """`tiles` with K/V tiles and pipeline stages cut until a program's shared memory
    fits the device: the query tile plus `num_stages` K/V tiles of `block_n` rows
    (what Triton 3.6 allocates for sm90, within 2 KiB). DeepSeek's 576-value latent
    rows need this; head dims up to 128 keep the tuned tiles.

    Raises ValueError when even one 16-row stage does not fit (MLA with 64+ query
    heads per rank and the 512 + 64 latent: shard the heads with tensor parallelism)."""
    limit = _shared_memory(device) - 4096  # the softmax rows and Triton's own scratch
    block_n, stages = tiles.block_n, tiles.num_stages
    while (block_m + stages * block_n) * head_dim_p2 * itemsize > limit:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif stages > 1:
            stages -= 1
        else:
            raise ValueError(
                f"paged attention of {block_m} query rows x head dim {head_dim_p2} does not "
                f"fit in {limit + 4096} bytes of shared memory; use fewer query heads per "
                "KV head on a rank (tensor_parallel_size)"
            )
    return Tiles(tiles.block_m, block_n, tiles.num_warps, stages)


def decode_splits(
    num_seqs: int, num_kv_heads: int, max_kv_tokens: int, device: torch.device
) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU twice over.

    On an H200 this matched the best measured count for batch 1 to 256 at 768 to
    8192 tokens (short single sequences excepted, within 15%): splitting a batch
    that already fills the GPU only adds merge traffic. A power of two
    (the merge kernel tiles over it), at most one per tile of the block table's
    width, so the choice depends on shapes alone.
    """
    splits = triton.next_power_of_2(triton.cdiv(2 * _num_sms(device), num_seqs * num_kv_heads))
    cap = min(MAX_SPLITS, max_kv_tokens // DECODE_TILES.block_n)
    while splits > 1 and splits > cap:
        splits //= 2
    return splits


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: Tiles | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query (T, Hq, D) over caches (num_blocks, block_size, Hkv, D) of any strides; with
    `sliding_window` W each query sees the keys of its last W positions only (the blocks
    before them are never read, so they may be freed); a prefill with
    `metadata.key_bounds` sees up to those positions (images seen whole).

    `out` (T, Hq, D) is written if given; `num_splits` (a power of two) overrides
    the decode split count and `tiles` the launch shape (benchmarks/bench_attention.py
    sweeps both).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    key_bounds = metadata.key_bounds if metadata.is_prefill else None
    num_seqs, table_width = metadata.block_tables.shape
    assert metadata.block_tables.stride(1) == 1, "block table rows must be contiguous"
    if metadata.is_prefill:
        tiles, splits, max_q_len = tiles or PREFILL_TILES, 1, metadata.max_seqlen_q
    else:
        tiles, max_q_len = tiles or DECODE_TILES, 1
        seen = min(table_width * block_size, sliding_window or NO_WINDOW)  # keys per query
        splits = num_splits or decode_splits(num_seqs, num_kv_heads, seen, query.device)
        assert splits & (splits - 1) == 0, "num_splits must be a power of two"
    group = num_q_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_m = max(tiles.block_m, group_p2)
    head_dim_p2 = max(triton.next_power_of_2(head_dim), 16)  # tl.dot needs K >= 16

    tiles = fit_tiles(tiles, block_m, head_dim_p2, query.element_size(), query.device)

    part_out = part_lse = out  # placeholders, unused when there is a single split
    if splits > 1:
        part_out = query.new_empty((num_tokens, num_q_heads, splits, head_dim), dtype=torch.float32)
        part_lse = query.new_empty((num_tokens, num_q_heads, splits), dtype=torch.float32)
    grid = (triton.cdiv(max_q_len, block_m // group_p2) * splits, num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        part_out,
        part_lse,
        query,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.context_lens,
        metadata.cu_seqlens_q,
        metadata.context_lens if key_bounds is None else key_bounds,  # unread without
        scale * _LOG2E,
        sliding_window or NO_WINDOW,
        num_q_heads,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        metadata.block_tables.stride(0),
        GROUP=group,
        GROUP_P2=group_p2,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        NUM_SPLITS=splits,
        UNMASKED_FIRST=metadata.is_prefill and sliding_window is None,
        KEY_BOUNDS=key_bounds is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **pdl_launch(query.device),
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_lse,
            num_q_heads,
            *out.stride(),
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim_p2,
            NUM_SPLITS=splits,
            **pdl_launch(query.device),
        )
    return out


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each packed sequence, as a prefill over a one-token-page cache.

    Token `t` of the packed key/value is page `t`, so sequence `s` reads pages
    `cu_seqlens[s]:cu_seqlens[s + 1]`. Reads the longest length back to the host:
    this path serves the eager profiling run, never a captured graph.
    """
    seq_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    pages = torch.arange(max_len, dtype=torch.int32, device=query.device)
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=cu_seqlens.new_empty(0, dtype=torch.int64),
        cu_seqlens_q=cu_seqlens.to(torch.int32),
        context_lens=seq_lens,
        block_tables=cu_seqlens[:-1, None].to(torch.int32) + pages,
        max_seqlen_q=max_len,
        max_context_len=max_len,
    )
    return paged_attention(query, key.unsqueeze(1), value.unsqueeze(1), metadata, scale)
