"""A decode step's attention for one new token per sequence, from qkv to output, in one kernel.

Three kernels did this before: q/k norm + rotary + KV store (extkv.kernels.rotary), the
split-K paged attention, and the merge of its splits (extkv.kernels.paged_attention).
Each boundary waits for the whole previous grid, and each kernel's first loads wait on
DRAM after that: at batch 1 the three took ~9 us of a ~30 us Qwen3-0.6B layer on an
H100 (BENCHMARKS.md, 2026-12-05 session 6). Here a program owns one split of one
(sequence, KV head)'s context and

1. before `wait_for_previous_grid`, loads its split's first K/V tile: keys earlier steps
   wrote, which no kernel of this step touches, so they stream in while the kernel
   before (the qkv projection) finishes; and the step's position, slot, cos/sin and
   q/k norm weights, so that after the wait only qkv is a round trip away;
2. norms and rotates its GQA group's q rows out of qkv; the program whose split ends at
   the new token also norms and rotates that token's k, stores k and v in the cache,
   and starts its softmax with that key, from registers;
3. attends over the rest of its split, the first tile from registers, the others as the
   paged kernel does, and writes its partial output; the last split of a (sequence, KV
   head) to arrive merges them (extkv.kernels.arrivals), in split order, all the group's
   heads in one round trip (`merge_heads`).

Sums run in another order than the three kernels' (the new key first, in fp32 products
rather than the tensor cores'), so outputs agree within the dtype's roundings, not bit
for bit. EXTKV_DECODE_ATTENTION=0 keeps the three kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from extkv.attention.metadata import AttentionMetadata
from extkv.kernels.arrivals import arrival_counters
from extkv.kernels.paged_attention import (
    NO_WINDOW,
    attend_tile,
    decode_splits,
    softmax_step,
)
from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid
from extkv.kernels.rotary import check_qkv_shapes, norm_pair, rope_factors, rotate

_LOG2E = math.log2(math.e)
TILE_ELEMENTS = 8192  # a K (and a V) tile's keys x head dim: 64 keys of 128, 32 of 256
NUM_WARPS = 4
MERGE_ELEMENTS = 8192  # fp32 partial outputs merged at once: 64 registers a thread of 4 warps


@triton.jit
def _kv_tile(cache_ptr, page, offset, kv_head, dim, mask, stride_b, stride_s, stride_h, stride_d):
    rows = page[:, None] * stride_b + offset[:, None] * stride_s + kv_head * stride_h
    return tl.load(cache_ptr + rows + dim[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def _merged_heads(part_out_ptr, part_lse_ptr, parts, head_ok, dim, dim_ok, HEAD_DIM: tl.constexpr):
    """(heads, HEAD_DIM) outputs of several heads at once from their splits' partial
    outputs and log2-sum-exps at rows `parts` (heads, splits): `merged_splits` of each
    head, every load in one round trip (a head at a time waits out one each)."""
    lse = tl.load(
        part_lse_ptr + parts, mask=head_ok[:, None], other=float("-inf"), cache_modifier=".cv"
    )
    lse_max = tl.max(lse, 1)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max)[:, None])
    o_ptrs = part_out_ptr + parts[:, :, None] * HEAD_DIM + dim[None, None, :]
    o_mask = head_ok[:, None, None] & dim_ok[None, None, :]
    o = tl.load(o_ptrs, mask=o_mask, other=0.0, cache_modifier=".cv")
    total = tl.sum(weight, 1)
    return tl.sum(weight[:, :, None] * o, 1) / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _decode_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    arrivals_ptr,
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_tables_ptr,
    context_lens_ptr,
    eps,
    qk_scale,
    window,
    stride_qkv,
    stride_cos_sin,
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
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_HEADS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (NUM_SPLITS, num_seqs, NUM_KV_HEADS); rows: the KV head's GROUP query heads
    (padded to BLOCK_M for the tensor cores), softmax in fp32, log2-scaled."""
    split = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    dim = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dim < HEAD_DIM

    # The split's keys, as the paged kernel splits them: the new token is the last.
    context_len = tl.load(context_lens_ptr + seq)
    new_pos = context_len - 1
    kv_begin = tl.maximum(context_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(context_len - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = kv_begin + split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, context_len)
    cached_hi = tl.minimum(kv_hi, new_pos)  # the keys already in the cache
    table_ptr = block_tables_ptr + seq * stride_bt
    kv_pos = kv_lo + tl.arange(0, BLOCK_N)
    kv_ok = kv_pos < cached_hi
    page = tl.load(table_ptr + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    tile_ok = kv_ok[:, None] & dim_ok[None, :]
    offset = kv_pos % BLOCK_SIZE
    k = _kv_tile(
        k_cache_ptr, page, offset, kv_head, dim, tile_ok,
        stride_kb, stride_ks, stride_kh, stride_kd,
    )  # fmt: skip
    v = _kv_tile(
        v_cache_ptr, page, offset, kv_head, dim, tile_ok,
        stride_vb, stride_vs, stride_vh, stride_vd,
    )  # fmt: skip
    # The step's inputs and constant tables, which no kernel of the step writes, too.
    cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * stride_cos_sin
    partner, cos, sin = rope_factors(cos_sin_row, dim[None, :], ROTARY_DIM)
    q_w, q_wp = norm_pair(q_weight_ptr, dim[None, :], partner, HEAD_DIM, HAS_NORM)
    k_w, k_wp = norm_pair(k_weight_ptr, dim[None, :], partner, HEAD_DIM, HAS_NORM)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    wait_for_previous_grid(USE_PDL)

    row_ptr = qkv_ptr + seq.to(tl.int64) * stride_qkv
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    q_live = row_ok[:, None] & dim_ok[None, :]
    q = rotate(
        row_ptr, head[:, None], dim[None, :], q_live, partner, cos, sin, q_w, q_wp, eps,
        HEAD_DIM, ROTARY_DIM, HAS_NORM,
    ).to(qkv_ptr.dtype.element_ty)  # fmt: skip

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    if (kv_lo <= new_pos) & (new_pos < kv_hi):  # this split ends at the new token
        k_row = row_ptr + NUM_Q_HEADS * HEAD_DIM
        live = dim_ok[None, :]
        k_new = rotate(
            k_row, kv_head, dim[None, :], live, partner, cos, sin, k_w, k_wp, eps,
            HEAD_DIM, ROTARY_DIM, HAS_NORM,
        ).to(k_cache_ptr.dtype.element_ty)  # fmt: skip
        v_row = k_row + NUM_KV_HEADS * HEAD_DIM + kv_head * HEAD_DIM
        v_new = tl.load(v_row + dim[None, :], mask=live, other=0.0).to(v_cache_ptr.dtype.element_ty)
        if slot >= 0:  # -1: a padding row, its slot stays untouched
            slot_block, slot_offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_dst = k_cache_ptr + slot_block * stride_kb + slot_offset * stride_ks
            v_dst = v_cache_ptr + slot_block * stride_vb + slot_offset * stride_vs
            k_dst += kv_head * stride_kh
            v_dst += kv_head * stride_vh
            tl.store(k_dst + dim[None, :] * stride_kd, k_new, mask=live)
            tl.store(v_dst + dim[None, :] * stride_vd, v_new, mask=live)
        row_max = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale
        row_sum = tl.full([BLOCK_M], 1.0, tl.float32)
        acc += v_new.to(tl.float32)

    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(kv_ok[None, :], s, float("-inf"))
    p, alpha, row_max, row_sum = softmax_step(s, row_max, row_sum, True)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    q_pos = tl.full([BLOCK_M], 0, tl.int32) + new_pos
    for start in range(kv_lo + BLOCK_N, cached_hi, BLOCK_N):
        row_max, row_sum, acc = attend_tile(
            q, q_pos, q_pos, start, cached_hi, window, qk_scale, row_max, row_sum, acc,
            k_cache_ptr, v_cache_ptr, table_ptr, kv_head, dim, dim_ok,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE, BLOCK_N, DOT_PRECISION, True,
        )  # fmt: skip

    safe_sum = tl.where(row_sum > 0, row_sum, 1.0)  # 0 only where the split had no key
    io_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + seq * stride_ot + head[:, None] * stride_oh + dim[None, :] * stride_od
        tl.store(o_ptrs, (acc / safe_sum[:, None]).to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (seq * NUM_Q_HEADS + head) * NUM_SPLITS + split
        lse = tl.where(row_sum > 0, row_max + tl.log2(safe_sum), float("-inf"))
        part_ptrs = part_out_ptr + part[:, None] * HEAD_DIM + dim[None, :]
        tl.store(part_ptrs, acc / safe_sum[:, None], mask=io_mask, cache_modifier=".wt")
        tl.store(part_lse_ptr + part, lse, mask=row_ok, cache_modifier=".wt")
        tl.debug_barrier()  # every thread's partial is written before the split counts
        counter = arrivals_ptr + seq * NUM_KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            splits = tl.arange(0, NUM_SPLITS)
            for first in tl.static_range(0, GROUP, MERGE_HEADS):  # one round trip a chunk
                g = first + tl.arange(0, MERGE_HEADS)
                h = kv_head * GROUP + g
                g_ok = g < GROUP  # the last chunk's padding heads
                parts = (seq * NUM_Q_HEADS + h)[:, None] * NUM_SPLITS + splits[None, :]
                o = _merged_heads(part_out_ptr, part_lse_ptr, parts, g_ok, dim, dim_ok, HEAD_DIM)
                o_ptrs = out_ptr + seq * stride_ot + h[:, None] * stride_oh
                o_ptrs += dim[None, :] * stride_od
                o_mask = g_ok[:, None] & dim_ok[None, :]
                tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(counter, 0)  # ready for the next call


def block_n(head_dim: int) -> int:
    """Keys a tile: TILE_ELEMENTS over the padded head dim (the first tile of K and of V
    sit in registers through the wait), at least 16 for the tensor cores."""
    return max(16, TILE_ELEMENTS // max(triton.next_power_of_2(head_dim), 16))


def merge_heads(group: int, splits: int, head_dim: int) -> int:
    """Heads the last split merges in one round trip: the whole GQA group (padded to a
    power of two) where its partial outputs take at most MERGE_ELEMENTS."""
    per_head = splits * max(triton.next_power_of_2(head_dim), 16)
    return min(triton.next_power_of_2(group), max(1, MERGE_ELEMENTS // per_head))


def rope_store_decode_attention(
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
    num_splits: int | None = None,
) -> torch.Tensor:
    """`extkv.attention.ops.rope_store_attention` of a decode step (one new token a
    sequence, qkv (num_seqs, (Hq + 2 Hkv) * D)) in one kernel: returns (num_seqs, Hq, D)
    and writes each token's k and v at its slot (-1 skips). `num_splits` (a power of
    two) overrides `decode_splits`' count."""
    head_dim = k_cache.shape[-1]
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads "
            f"({num_kv_heads}): each KV head serves a whole group of query heads"
        )
    check_qkv_shapes(qkv, cos_sin_cache, num_q_heads + 2 * num_kv_heads, head_dim)
    num_seqs, table_width = metadata.block_tables.shape
    if metadata.is_prefill or qkv.shape[0] != num_seqs:
        raise ValueError(
            f"rope_store_decode_attention takes a decode step, one token a sequence; got "
            f"{qkv.shape[0]} tokens of {num_seqs} sequences (is_prefill={metadata.is_prefill})"
        )
    assert metadata.block_tables.stride(1) == 1, "block table rows must be contiguous"
    out = qkv.new_empty(num_seqs, num_q_heads, head_dim)
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    seen = min(table_width * block_size, sliding_window or NO_WINDOW)
    splits = num_splits or decode_splits(num_seqs, num_kv_heads, seen, qkv.device)
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    group = num_q_heads // num_kv_heads
    part_out = part_lse = arrivals = out  # placeholders, unused with a single split
    if splits > 1:
        part_out = qkv.new_empty((num_seqs, num_q_heads, splits, head_dim), dtype=torch.float32)
        part_lse = qkv.new_empty((num_seqs, num_q_heads, splits), dtype=torch.float32)
        arrivals = arrival_counters("decode_attention", qkv.device, num_seqs * num_kv_heads)
    has_norm = q_norm_weight is not None
    _decode_attention_kernel[(splits, num_seqs, num_kv_heads)](
        out,
        part_out,
        part_lse,
        arrivals,
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else qkv,  # never read without HAS_NORM
        k_norm_weight if has_norm else qkv,
        k_cache,
        v_cache,
        metadata.slot_mapping,
        metadata.block_tables,
        metadata.context_lens,
        eps,
        scale * _LOG2E,
        sliding_window or NO_WINDOW,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        metadata.block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(triton.next_power_of_2(head_dim), 16),
        ROTARY_DIM=cos_sin_cache.shape[1],
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n(head_dim),
        NUM_SPLITS=splits,
        MERGE_HEADS=merge_heads(group, splits, head_dim),
        HAS_NORM=has_norm,
        DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        **pdl_launch(qkv.device),
    )
    return out
