"""The rest of a decode layer after its attention in one persistent kernel: the output
projection (optional), RMSNorm(x + residual) and gate_up, silu(gate) * up and down,
with a grid barrier where separate GEMV kernels had a boundary.

Every stage is the small-batch GEMV's (`gemv_tile`, the same tiling and the same order
of every sum), so the outputs are those of `linear_small_batch`,
`rms_norm_linear_small_batch` and `silu_and_mul_linear_small_batch`, bit for bit. What
goes is the boundaries: every program first asks L2 for its slice of each stage's
weight, then for its share of the next kernel's (`prefetch`), which stream in while
the stages wait on latency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.gemv import (
    MAX_ROWS,
    PLAIN,
    RMS_NORM,
    SILU_AND_MUL,
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
from extkv.kernels.pdl import (
    next_weights,
    pdl_launch,
    prefetch_next_weights,
    wait_for_previous_grid,
)

# The stages, in order; a launch runs FIRST to LAST of them: all of a call's, with
# barriers between them, or one at a time (the interpreter's launches).
OUT_PROJ, GATE_UP, DOWN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _gated_mlp_kernel(
    attn_ptr,
    out_w_ptr,
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    residual_out_ptr,
    gate_up_w_ptr,
    gate_up_ptr,
    down_w_ptr,
    y_ptr,
    partial_ptr,
    arrivals_ptr,
    barrier_ptr,
    out_w_address,
    gate_up_w_address,
    down_w_address,
    next_address0,
    next_bytes0,
    next_address1,
    next_bytes1,
    next_address2,
    next_bytes2,
    num_rows,
    attn_width,
    hidden,
    inner,
    out_k_per_split,
    gate_up_k_per_split,
    down_k_per_split,
    stride_am,
    stride_out_wn,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_gate_up_wn,
    stride_gate_up_m,
    stride_down_wn,
    stride_ym,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    OUT_BLOCK_K: tl.constexpr,
    OUT_SPLIT: tl.constexpr,
    OUT_LINE: tl.constexpr,
    GATE_UP_BLOCK_K: tl.constexpr,
    GATE_UP_SPLIT: tl.constexpr,
    GATE_UP_LINE: tl.constexpr,
    K_CHUNKS: tl.constexpr,
    DOWN_BLOCK_K: tl.constexpr,
    DOWN_SPLIT: tl.constexpr,
    DOWN_LINE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    NUM_NEXT: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Stages FIRST to LAST (OUT_PROJ: x = attn @ out_w^T; GATE_UP: gate_up of
    RMSNorm(residual + x); DOWN: y = down of silu(gate) * up), a barrier between each two.
    Each program takes a stage's work items (tile, slice of K) strided by the number of
    programs. With PREFETCH (PDL) it first asks L2 for the weight of its first item of
    each stage, before the wait for the previous kernel."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    gate_up_n = 2 * inner
    out_items = tl.cdiv(hidden, BLOCK_N) * OUT_SPLIT
    gate_up_items = tl.cdiv(gate_up_n, BLOCK_N) * GATE_UP_SPLIT
    down_items = tl.cdiv(hidden, BLOCK_N) * DOWN_SPLIT
    if PREFETCH:
        if FIRST <= OUT_PROJ and pid < out_items:
            prefetch_tile(
                pid // OUT_SPLIT, pid % OUT_SPLIT, out_w_address, out_w_ptr, hidden,
                attn_width, out_k_per_split, stride_out_wn, BLOCK_N, OUT_BLOCK_K, OUT_LINE,
            )  # fmt: skip
        if FIRST <= GATE_UP and LAST >= GATE_UP and pid < gate_up_items:
            prefetch_tile(
                pid // GATE_UP_SPLIT, pid % GATE_UP_SPLIT, gate_up_w_address, gate_up_w_ptr,
                gate_up_n, hidden, gate_up_k_per_split, stride_gate_up_wn, BLOCK_N,
                GATE_UP_BLOCK_K, GATE_UP_LINE,
            )  # fmt: skip
        if LAST >= DOWN and pid < down_items:
            prefetch_tile(
                pid // DOWN_SPLIT, pid % DOWN_SPLIT, down_w_address, down_w_ptr, hidden, inner,
                down_k_per_split, stride_down_wn, BLOCK_N, DOWN_BLOCK_K, DOWN_LINE,
            )  # fmt: skip
    wait_for_previous_grid(USE_PDL)
    if PREFETCH:  # the weights of the kernel after this one, while this one reads L2
        prefetch_next_weights(
            next_address0, next_bytes0, next_address1, next_bytes1, next_address2, next_bytes2,
            pid, programs, NUM_NEXT,
        )  # fmt: skip
    if FIRST <= OUT_PROJ:
        for item in range(pid, out_items, programs):
            gemv_tile(
                item // OUT_SPLIT, item % OUT_SPLIT, attn_ptr, out_w_ptr, out_w_ptr, x_ptr,
                partial_ptr, arrivals_ptr, attn_ptr, out_w_ptr, x_ptr, num_rows, hidden,
                attn_width, out_k_per_split, stride_am, stride_out_wn, stride_xm, 0, 0, eps,
                PLAIN, False, False, BLOCK_N, OUT_BLOCK_K, BLOCK_M, OUT_SPLIT, 1,
                DOT_PRECISION,
            )  # fmt: skip
    if FIRST < GATE_UP and LAST >= GATE_UP:
        grid_barrier(barrier_ptr, programs)
    if FIRST <= GATE_UP and LAST >= GATE_UP:
        for item in range(pid, gate_up_items, programs):
            gemv_tile(
                item // GATE_UP_SPLIT, item % GATE_UP_SPLIT, x_ptr, gate_up_w_ptr,
                gate_up_w_ptr, gate_up_ptr, partial_ptr, arrivals_ptr, residual_ptr,
                norm_weight_ptr, residual_out_ptr, num_rows, gate_up_n, hidden,
                gate_up_k_per_split, stride_xm, stride_gate_up_wn, stride_gate_up_m,
                stride_rm, stride_rom, eps, RMS_NORM, HAS_RESIDUAL, False, BLOCK_N,
                GATE_UP_BLOCK_K, BLOCK_M, GATE_UP_SPLIT, K_CHUNKS, DOT_PRECISION,
            )  # fmt: skip
    if FIRST < DOWN and LAST >= DOWN:
        grid_barrier(barrier_ptr, programs)
    if LAST >= DOWN:
        for item in range(pid, down_items, programs):
            gemv_tile(
                item // DOWN_SPLIT, item % DOWN_SPLIT, gate_up_ptr, down_w_ptr, down_w_ptr,
                y_ptr, partial_ptr, arrivals_ptr, gate_up_ptr, down_w_ptr, y_ptr, num_rows,
                hidden, inner, down_k_per_split, stride_gate_up_m, stride_down_wn, stride_ym,
                0, 0, eps, SILU_AND_MUL, False, False, BLOCK_N, DOWN_BLOCK_K, BLOCK_M,
                DOWN_SPLIT, 1, DOT_PRECISION,
            )  # fmt: skip


def gated_mlp_small_batch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    out_weight: torch.Tensor | None = None,
    prefetch: tuple[torch.Tensor, ...] = (),
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate) * up) of RMSNorm(residual + x), the residual stream) for at most
    MAX_ROWS rows, no biases: gate_up_weight (2I, H), gate then up; down_weight (H, I).
    With `out_weight` (H, A), x is an attention's output (M, A) and goes through that
    projection first: the rest of a decoder layer after its attention. The same bits as
    the GEMVs it replaces; the stream as theirs, a new tensor (without a residual, the
    MLP's input itself). `prefetch`: up to three weights the next kernel reads, asked of
    L2 (on CUDA with PDL) while this one runs from it. `num_stages`: the GEMV loops' pipeline
    depth (None: the GEMV's); fewer leave shared memory for the next kernel's programs to
    start beside these (benchmarks/bench_persistent.py --stages sweeps it)."""
    check_num_stages(num_stages)
    first_weight = gate_up_weight if out_weight is None else out_weight  # what x meets
    check_operands(x, first_weight, None, x.shape[-1])
    attn = None
    if out_weight is not None:
        attn, x = x, x.new_empty(x.shape[0], out_weight.shape[0])
    hidden = x.shape[-1]
    check_norm_operands(x, residual, norm_weight)
    inner = gate_up_weight.shape[0] // 2
    if gate_up_weight.shape != (2 * inner, hidden):
        raise ValueError(
            f"gate_up_weight must be (2I, {hidden}), got {tuple(gate_up_weight.shape)}"
        )
    if down_weight.shape != (hidden, inner) or down_weight.stride(1) != 1:
        raise ValueError(
            f"down_weight must be ({hidden}, {inner}) with contiguous rows, "
            f"got {tuple(down_weight.shape)}"
        )
    if down_weight.dtype != x.dtype:
        raise ValueError(f"down_weight's dtype {down_weight.dtype} must be x's ({x.dtype})")
    num_rows = x.shape[0]
    residual_out = x if residual is None else torch.empty_like(residual)
    gate_up = x.new_empty(num_rows, 2 * inner)
    y = x.new_empty(num_rows, hidden)
    if not num_rows:
        return y, residual_out
    out = up = Tiling.of(gate_up_weight)
    if out_weight is not None:
        out = Tiling.of(out_weight)
    down = Tiling.of(down_weight)
    partials, arrivals = split_scratch(y, out, up, down)
    launch = pdl_launch(x.device)
    grid = persistent_grid(max(out.items, up.items, down.items), num_sms(x.device))
    stages = (OUT_PROJ, GATE_UP, DOWN) if attn is not None else (GATE_UP, DOWN)
    next_addresses, next_count = next_weights(prefetch)
    for first, last in stage_launches(stages, x.device):
        _gated_mlp_kernel[(grid,)](
            x if attn is None else attn,  # never read without OUT_PROJ
            first_weight,  # the output projection's, read by OUT_PROJ only
            x,
            x if residual is None else residual,  # never read without HAS_RESIDUAL
            norm_weight,
            residual_out,
            gate_up_weight,
            gate_up,
            down_weight,
            y,
            partials,
            arrivals,
            barrier_counter("gated_mlp", x.device, grid),
            first_weight.data_ptr(),
            gate_up_weight.data_ptr(),
            down_weight.data_ptr(),
            *next_addresses,
            num_rows,
            0 if attn is None else attn.shape[1],
            hidden,
            inner,
            out.k_per_split,
            up.k_per_split,
            down.k_per_split,
            0 if attn is None else attn.stride(0),
            0 if out_weight is None else out_weight.stride(0),
            x.stride(0),
            0 if residual is None else residual.stride(0),
            residual_out.stride(0),
            gate_up_weight.stride(0),
            gate_up.stride(0),
            down_weight.stride(0),
            y.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=up.config.block_n,
            BLOCK_M=MAX_ROWS,
            OUT_BLOCK_K=out.config.block_k,
            OUT_SPLIT=out.config.split_k,
            OUT_LINE=out.line_elements,
            GATE_UP_BLOCK_K=up.config.block_k,
            GATE_UP_SPLIT=up.config.split_k,
            GATE_UP_LINE=up.line_elements,
            K_CHUNKS=up.k_chunks,
            DOWN_BLOCK_K=down.config.block_k,
            DOWN_SPLIT=down.config.split_k,
            DOWN_LINE=down.line_elements,
            DOT_PRECISION=dot_precision(x.dtype),
            PREFETCH=launch["USE_PDL"],
            NUM_NEXT=next_count,
            FIRST=first,
            LAST=last,
            num_warps=up.config.num_warps,
            num_stages=num_stages or up.config.num_stages,
            **launch,
        )
    return y, residual_out
