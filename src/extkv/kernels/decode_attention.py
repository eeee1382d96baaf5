"""A decode step's attention sublayer in one persistent kernel: RMSNorm(x + residual) and
the qkv projection, q/k norm + rotary + KV store, paged attention over key splits, and
the merge of the splits, with a grid barrier where four kernels had a boundary.

Each stage is the tile function of the kernel it replaces (`gemv_tile`,
`qk_norm_rope_store_tile`, `attention_tile`, `merge_splits_tile`), with the same tiling
and split count, so the output is theirs bit for bit. At the start every program asks
L2 for its slice of the qkv weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.attention.metadata import AttentionMetadata
from extkv.kernels.gemv import (
    MAX_ROWS,
    RMS_NORM,
    Tiling,
    check_norm_operands,
    check_operands,
    dot_precision,
    gemv_tile,
    num_sms,
    prefetch_tile,
    split_scratch,
)
from extkv.kernels.grid_barrier import (
    barrier_counter,
    check_num_stages,
    grid_barrier,
    persistent_grid,
    stage_launches,
)
from extkv.kernels.paged_attention import (
    DECODE_TILES,
    LOG2E,
    NO_WINDOW,
    GroupTiling,
    attention_tile,
    decode_key_splits,
    merge_splits_tile,
    split_partials,
)
from extkv.kernels.pdl import (
    next_weights,
    pdl_launch,
    prefetch_next_weights,
    wait_for_previous_grid,
)
from extkv.kernels.rotary import check_rotary_table, qk_norm_rope_store_tile, tile_heads

# The stages, in order; a launch runs FIRST to LAST of them (see gated_mlp).
QKV, PREPARE, ATTEND, MERGE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _decode_attention_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    residual_out_ptr,
    qkv_w_ptr,
    qkv_bias_ptr,
    qkv_ptr,
    partial_ptr,
    arrivals_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    context_lens_ptr,
    cu_seqlens_q_ptr,
    barrier_ptr,
    qkv_w_address,
    next_address0,
    next_bytes0,
    next_address1,
    next_bytes1,
    next_address2,
    next_bytes2,
    num_rows,
    num_seqs,
    hidden,
    qkv_width,
    qkv_k_per_split,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_qkv_wn,
    stride_qkv,
    stride_cos_sin,
    stride_qt,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    eps,
    qk_eps,
    qk_scale,
    window,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GEMV_BLOCK_N: tl.constexpr,
    GEMV_BLOCK_K: tl.constexpr,
    GEMV_BLOCK_M: tl.constexpr,
    QKV_SPLIT: tl.constexpr,
    K_CHUNKS: tl.constexpr,
    LINE_ELEMENTS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    ROPE_DIM_P2: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    Q_TILES: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_P2: tl.constexpr,
    ATTEND_BLOCK_M: tl.constexpr,
    ATTEND_BLOCK_N: tl.constexpr,
    ATTEND_STAGES: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    NUM_NEXT: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Stages FIRST to LAST (QKV: qkv of RMSNorm(residual + x); PREPARE: q normed and
    rotated to `q_ptr`, k and v to the cache; ATTEND: each (sequence, KV head, split);
    MERGE: the splits of each (token, head), where there are several), a barrier between
    each two; each program takes a stage's work items strided by the number of programs."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    qkv_items = tl.cdiv(qkv_width, GEMV_BLOCK_N) * QKV_SPLIT
    if PREFETCH and FIRST <= QKV and pid < qkv_items:
        prefetch_tile(
            pid // QKV_SPLIT, pid % QKV_SPLIT, qkv_w_address, qkv_w_ptr, qkv_width, hidden,
            qkv_k_per_split, stride_qkv_wn, GEMV_BLOCK_N, GEMV_BLOCK_K, LINE_ELEMENTS,
        )  # fmt: skip
    wait_for_previous_grid(USE_PDL)
    if FIRST <= QKV:
        for item in range(pid, qkv_items, programs):
            gemv_tile(
                item // QKV_SPLIT, item % QKV_SPLIT, x_ptr, qkv_w_ptr, qkv_bias_ptr, qkv_ptr,
                partial_ptr, arrivals_ptr, residual_ptr, norm_weight_ptr, residual_out_ptr,
                num_rows, qkv_width, hidden, qkv_k_per_split, stride_xm, stride_qkv_wn,
                stride_qkv, stride_rm, stride_rom, eps, RMS_NORM, HAS_RESIDUAL, HAS_BIAS,
                GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_BLOCK_M, QKV_SPLIT, K_CHUNKS, DOT_PRECISION,
            )  # fmt: skip
    if PREFETCH:  # the next kernel's weights, while the stages below wait on latency
        prefetch_next_weights(
            next_address0, next_bytes0, next_address1, next_bytes1, next_address2, next_bytes2,
            pid, programs, NUM_NEXT,
        )  # fmt: skip
    if FIRST < PREPARE and LAST >= PREPARE:
        grid_barrier(barrier_ptr, programs)
    if FIRST <= PREPARE and LAST >= PREPARE:
        tiles = Q_TILES + tl.cdiv(NUM_KV_HEADS, HEADS)
        for item in range(pid, num_rows * tiles, programs):
            qk_norm_rope_store_tile(
                item // tiles, item % tiles, qkv_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr,
                k_norm_ptr, q_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_qkv,
                stride_cos_sin, stride_qt, stride_qh, 0, 0, stride_kcb, stride_kcs, stride_kch,
                stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd, qk_eps,
                NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, ROPE_DIM_P2, ROTARY_DIM, HEADS, Q_TILES,
                BLOCK_SIZE, HAS_QK_NORM, False,
            )  # fmt: skip
    if FIRST < ATTEND and LAST >= ATTEND:
        grid_barrier(barrier_ptr, programs)
    if FIRST <= ATTEND and LAST >= ATTEND:
        per_seq = NUM_KV_HEADS * NUM_SPLITS
        for item in range(pid, num_seqs * per_seq, programs):
            attention_tile(
                0, item % NUM_SPLITS, item // per_seq, item // NUM_SPLITS % NUM_KV_HEADS,
                out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr, context_lens_ptr,
                qk_scale, window, NUM_Q_HEADS, stride_qt, stride_qh, 1, stride_kcb,
                stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch,
                stride_vcd, stride_ot, stride_oh, stride_od, stride_bt,
                NUM_Q_HEADS // NUM_KV_HEADS, GROUP_P2, HEAD_DIM, HEAD_DIM_P2, BLOCK_SIZE,
                ATTEND_BLOCK_M, ATTEND_BLOCK_N, NUM_SPLITS, False, False, DOT_PRECISION,
                ATTEND_STAGES,
            )  # fmt: skip
    if NUM_SPLITS > 1:
        if FIRST < MERGE and LAST >= MERGE:
            grid_barrier(barrier_ptr, programs)
        if LAST >= MERGE:
            for item in range(pid, num_rows * NUM_Q_HEADS, programs):
                merge_splits_tile(
                    item // NUM_Q_HEADS, item % NUM_Q_HEADS, out_ptr, part_out_ptr,
                    part_lse_ptr, NUM_Q_HEADS, stride_ot, stride_oh, stride_od, HEAD_DIM,
                    HEAD_DIM_P2, NUM_SPLITS,
                )  # fmt: skip


def decode_attention_block(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    qk_eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    prefetch: tuple[torch.Tensor, ...] = (),
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's (one token per sequence, at most MAX_ROWS) attention sublayer:
    `rms_norm_linear_small_batch` to qkv, `qk_norm_rope_store` and `paged_attention`, in
    one kernel. Returns (out (T, Hq, D), the residual stream), the same bits as theirs.
    `prefetch`: up to three weights the next kernel reads, asked of L2 (on CUDA with PDL)
    once the qkv projection has read its own. `num_stages`: the qkv loop's pipeline depth, as
    `gated_mlp_small_batch`'s."""
    check_num_stages(num_stages)
    if metadata.is_prefill:
        raise ValueError("decode_attention_block takes a decode step's metadata, got a prefill's")
    check_operands(x, qkv_weight, qkv_bias, x.shape[-1])
    check_norm_operands(x, residual, norm_weight)
    head_dim = k_cache.shape[-1]
    if num_q_heads % num_kv_heads or k_cache.shape[2] != num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads}), "
            f"the caches' third dimension (got {k_cache.shape[2]})"
        )
    if metadata.block_tables.stride(1) != 1:
        raise ValueError("metadata.block_tables must have contiguous rows (stride(1) == 1)")
    heads_width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv_weight.shape[0] != heads_width:
        raise ValueError(
            f"qkv_weight must have (num_q_heads {num_q_heads} + 2 num_kv_heads "
            f"{num_kv_heads}) * head_dim {head_dim} = {heads_width} rows, "
            f"got {qkv_weight.shape[0]}"
        )
    check_rotary_table(cos_sin_cache, head_dim)
    num_rows, num_seqs = x.shape[0], metadata.num_seqs
    residual_out = x if residual is None else torch.empty_like(residual)
    out = x.new_empty(num_rows, num_q_heads, head_dim)
    if num_rows == 0:
        return out, residual_out
    qkv = x.new_empty(num_rows, qkv_weight.shape[0])
    q = torch.empty_like(out)
    qkv_tiling = Tiling.of(qkv_weight)
    partials, arrivals = split_scratch(qkv, qkv_tiling)
    block_size = k_cache.shape[1]
    splits = decode_key_splits(metadata, block_size, num_kv_heads, sliding_window, x.device)
    shape = GroupTiling.of(DECODE_TILES, num_q_heads, num_kv_heads, head_dim, x)
    part_out, part_lse = split_partials(out, num_q_heads, splits)
    rope_dim_p2, heads = tile_heads(num_q_heads, num_kv_heads, head_dim)
    q_tiles = triton.cdiv(num_q_heads, heads)
    prepare_items = num_rows * (q_tiles + triton.cdiv(num_kv_heads, heads))
    widest = max(qkv_tiling.items, prepare_items, num_seqs * num_kv_heads * splits)
    grid = persistent_grid(widest, num_sms(x.device))
    launch = pdl_launch(x.device)
    stages = (QKV, PREPARE, ATTEND, MERGE) if splits > 1 else (QKV, PREPARE, ATTEND)
    has_qk_norm = q_norm_weight is not None
    next_addresses, next_count = next_weights(prefetch)
    for first, last in stage_launches(stages, x.device):
        _decode_attention_kernel[(grid,)](
            x,
            x if residual is None else residual,  # never read without HAS_RESIDUAL
            norm_weight,
            residual_out,
            qkv_weight,
            qkv_weight if qkv_bias is None else qkv_bias,  # never read without HAS_BIAS
            qkv,
            partials,
            arrivals,
            positions,
            cos_sin_cache,
            q_norm_weight if has_qk_norm else x,  # never read without HAS_QK_NORM
            k_norm_weight if has_qk_norm else x,
            q,
            k_cache,
            v_cache,
            metadata.slot_mapping,
            out,
            part_out,
            part_lse,
            metadata.block_tables,
            metadata.context_lens,
            metadata.cu_seqlens_q,
            barrier_counter("decode_attention", x.device, grid),
            qkv_weight.data_ptr(),
            *next_addresses,
            num_rows,
            num_seqs,
            x.shape[1],
            qkv_weight.shape[0],
            qkv_tiling.k_per_split,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            residual_out.stride(0),
            qkv_weight.stride(0),
            qkv.stride(0),
            cos_sin_cache.stride(0),
            *q.stride()[:2],
            *k_cache.stride(),
            *v_cache.stride(),
            *out.stride(),
            metadata.block_tables.stride(0),
            eps,
            qk_eps,
            scale * LOG2E,
            sliding_window or NO_WINDOW,
            HAS_RESIDUAL=residual is not None,
            HAS_BIAS=qkv_bias is not None,
            GEMV_BLOCK_N=qkv_tiling.config.block_n,
            GEMV_BLOCK_K=qkv_tiling.config.block_k,
            GEMV_BLOCK_M=MAX_ROWS,
            QKV_SPLIT=qkv_tiling.config.split_k,
            K_CHUNKS=qkv_tiling.k_chunks,
            LINE_ELEMENTS=qkv_tiling.line_elements,
            NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=shape.head_dim_p2,
            ROPE_DIM_P2=rope_dim_p2,
            ROTARY_DIM=cos_sin_cache.shape[1],
            HEADS=heads,
            Q_TILES=q_tiles,
            HAS_QK_NORM=has_qk_norm,
            BLOCK_SIZE=block_size,
            GROUP_P2=shape.group_p2,
            ATTEND_BLOCK_M=shape.block_m,
            ATTEND_BLOCK_N=shape.tiles.block_n,
            ATTEND_STAGES=shape.tiles.num_stages,
            NUM_SPLITS=splits,
            DOT_PRECISION=dot_precision(x.dtype),
            PREFETCH=launch["USE_PDL"],
            NUM_NEXT=next_count,
            FIRST=first,
            LAST=last,
            num_warps=qkv_tiling.config.num_warps,
            num_stages=num_stages or qkv_tiling.config.num_stages,
            **launch,
        )
    return out, residual_out
