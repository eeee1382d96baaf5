"""A batch-1 decode step's MLP sublayer in one kernel whose weights wait in registers:
the attention's output projection (optional) and the residual add, RMSNorm and
gate_up, silu(gate) * up and down.

At batch 1 a layer's GEMVs are bound by latency, not bandwidth: each kernel boundary
drains the GPU, and each GEMV streams its few megabytes only after its input exists.
Here every program (one per SM) first loads its row slice of all three weights into
registers, before it waits for the kernel before (PDL); the stages then only read
their small inputs and reduce, with a grid barrier where the GEMVs had a boundary.
So the weights stream at once, at the full bandwidth, while the attention ends and the
stages' round trips run. On an H100, Qwen3-0.6B's shape: 14.0 us for the sublayer
against 18.7 for the three GEMVs, and a batch-1 decode step of 0.990 ms against 1.090
(BENCHMARKS.md, 2026-12-05 session 6).

A fourth stage making the next layer's norm + qkv (its weight slice loaded into the
registers gate/up's free) took a layer from 26.8 to 29.2 us in the engine beside the one-
kernel decode attention, which starts its K/V loads during the qkv GEMV (BENCHMARKS.md,
2026-12-05 session 7): it is gone. The norm + qkv is a one-row kernel of its own
(extkv.kernels.norm_linear).

The slices must fit in registers (`RegisterPlan.of` says when they do: small models,
the ones batch-1 latency matters most for); anything else takes the GEMVs. The sums
run in another order than the GEMVs' tiles, so outputs may differ from theirs in the
last bits: a sequence decoded alone (one row) is no longer bit for bit the same
sequence decoded beside others, as it is with the GEMVs alone (the price of the
latency; `EXTKV_PERSISTENT=0` keeps the GEMVs' batch invariance up to 16 rows).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from extkv.kernels.activation import silu_times
from extkv.kernels.gemv import num_sms
from extkv.kernels.grid_barrier import barrier_counter, grid_barrier, stage_launches
from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid
from extkv.kernels.register_slices import (
    check_normed_row,
    load_slice,
    load_vector,
    matvec,
    rms_normed_row,
    store_rows,
    two_powers,
)

# The stages, in order; a launch runs FIRST to LAST of them: all of a call's, with
# barriers between them, or one at a time (the interpreter's launches).
OUT_PROJ, GATE_UP, DOWN = 0, 1, 2

# Weight bytes a program may hold: Qwen3-0.6B's 176 KiB slices take 242 of the 255
# registers a thread of 8 warps has, without spills (sm90, Triton 3.6).
MAX_SLICE_BYTES = 184 * 1024
NUM_WARPS = 8


@dataclass(frozen=True)
class RegisterPlan:
    """How `gated_mlp_one_row` cuts an MLP over its programs: each takes `hidden_rows`
    rows of o_proj and down and `inner_rows` of gate and of up; every row count and K is
    two powers of two (the second 0 where one does; `attn_k` is (0, 0) without an output
    projection)."""

    programs: int
    hidden_rows: tuple[int, int]
    inner_rows: tuple[int, int]
    attn_k: tuple[int, int]
    hidden_k: tuple[int, int]
    inner_k: tuple[int, int]

    @classmethod
    @functools.cache
    def of(
        cls, hidden: int, inner: int, attn_width: int, itemsize: int, sms: int
    ) -> RegisterPlan | None:
        """The plan with the most programs (<= `sms`) that splits the rows evenly and
        whose slices fit in a program's registers; None if there is none."""
        ks = (
            two_powers(attn_width) if attn_width else (0, 0),
            two_powers(hidden),
            two_powers(inner),
        )
        if None in ks:
            return None
        for programs in range(min(sms, math.gcd(hidden, inner)), 0, -1):
            if hidden % programs or inner % programs:
                continue
            rows = two_powers(hidden // programs), two_powers(inner // programs)
            if None in rows:
                continue
            per_program = (hidden * (attn_width + inner) + 2 * inner * hidden) // programs
            if per_program * itemsize > MAX_SLICE_BYTES:
                return None  # fewer programs only make the slices larger
            return cls(programs, *rows, *ks)
        return None


@triton.jit
def _gated_mlp_kernel(
    attn_ptr,
    out_w_ptr,
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    stream_ptr,
    gate_up_w_ptr,
    act_ptr,
    down_w_ptr,
    y_ptr,
    barrier_ptr,
    attn_width,
    hidden,
    inner,
    eps,
    HAS_OUT_PROJ: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RO1: tl.constexpr,
    RO2: tl.constexpr,
    RI1: tl.constexpr,
    RI2: tl.constexpr,
    KA1: tl.constexpr,
    KA2: tl.constexpr,
    KH1: tl.constexpr,
    KH2: tl.constexpr,
    KI1: tl.constexpr,
    KI2: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Stages FIRST to LAST: OUT_PROJ (x = attn @ out_w^T, the stream residual + x),
    GATE_UP (silu(gate) * up of RMSNorm(stream)), DOWN (y), a barrier between each two.
    Program p owns rows p * (RO1 + RO2) ... of o_proj and down, p * (RI1 + RI2) ... of
    gate and of up; its weights are loaded before anything waits."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    hidden_row = pid * (RO1 + RO2)
    inner_row = pid * (RI1 + RI2)
    if HAS_OUT_PROJ and FIRST == 0:
        o11, o12, o21, o22 = load_slice(out_w_ptr, hidden_row, attn_width, RO1, RO2, KA1, KA2)
    if FIRST <= 1 and LAST >= 1:
        g11, g12, g21, g22 = load_slice(gate_up_w_ptr, inner_row, hidden, RI1, RI2, KH1, KH2)
        up_row = inner + inner_row
        u11, u12, u21, u22 = load_slice(gate_up_w_ptr, up_row, hidden, RI1, RI2, KH1, KH2)
    if LAST == 2:
        d11, d12, d21, d22 = load_slice(down_w_ptr, hidden_row, inner, RO1, RO2, KI1, KI2)
    wait_for_previous_grid(USE_PDL)

    if HAS_OUT_PROJ and FIRST == 0:
        a1, a2 = load_vector(attn_ptr, KA1, KA2)
        x1, x2 = matvec(o11, o12, o21, o22, a1.to(tl.float32), a2.to(tl.float32))
        store_rows(x_ptr, hidden_row, x1, x2, RO1, RO2)  # rounded as the GEMV's output
        if LAST >= 1:
            grid_barrier(barrier_ptr, programs)

    if FIRST <= 1 and LAST >= 1:
        nw1, nw2 = load_vector(norm_weight_ptr, KH1, KH2)  # with the row: no register held
        n1, n2 = rms_normed_row(
            x_ptr, residual_ptr, stream_ptr, nw1.to(tl.float32), nw2.to(tl.float32),
            hidden_row, hidden_row + RO1 + RO2, hidden, eps, HAS_RESIDUAL, KH1, KH2,
        )  # fmt: skip
        gate1, gate2 = matvec(g11, g12, g21, g22, n1, n2)
        up1, up2 = matvec(u11, u12, u21, u22, n1, n2)
        # gate and up rounded as the gate_up GEMV's output, then the activation's math
        gate1 = gate1.to(x_ptr.dtype.element_ty).to(tl.float32)
        gate2 = gate2.to(x_ptr.dtype.element_ty).to(tl.float32)
        up1 = up1.to(x_ptr.dtype.element_ty).to(tl.float32)
        up2 = up2.to(x_ptr.dtype.element_ty).to(tl.float32)
        act1 = silu_times(gate1, up1, x_ptr)
        act2 = silu_times(gate2, up2, x_ptr)
        store_rows(act_ptr, inner_row, act1, act2, RI1, RI2)
        if LAST == 2:
            grid_barrier(barrier_ptr, programs)

    if LAST == 2:
        h1, h2 = load_vector(act_ptr, KI1, KI2)
        y1, y2 = matvec(d11, d12, d21, d22, h1.to(tl.float32), h2.to(tl.float32))
        store_rows(y_ptr, hidden_row, y1, y2, RO1, RO2)


def _check_operands(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    out_weight: torch.Tensor | None,
) -> tuple[int, int, int]:
    """(hidden, inner, attn_width) of checked operands, naming the one that is off."""
    if down.dim() != 2 or gate_up.dim() != 2:
        raise ValueError(
            f"gate_up must be (2I, H) and down (H, I), got {tuple(gate_up.shape)} and "
            f"{tuple(down.shape)}"
        )
    hidden, inner = down.shape
    if gate_up.shape != (2 * inner, hidden):
        raise ValueError(f"gate_up must be ({2 * inner}, {hidden}), got {tuple(gate_up.shape)}")
    attn_width = hidden if out_weight is None else out_weight.shape[-1]
    if out_weight is not None and out_weight.shape != (hidden, attn_width):
        raise ValueError(f"out_weight must be ({hidden}, K), got {tuple(out_weight.shape)}")
    check_normed_row(x, attn_width, residual, norm_weight, hidden)
    weights = (gate_up, down) if out_weight is None else (gate_up, down, out_weight)
    for tensor in (x, residual, norm_weight, *weights):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError("gated_mlp_one_row needs contiguous operands")
    if any(w.dtype != x.dtype for w in weights):
        raise ValueError(f"the weights' dtype must be x's ({x.dtype})")
    return hidden, inner, attn_width


def plan_for(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    out_weight: torch.Tensor | None,
) -> RegisterPlan | None:
    """The register plan of this MLP on x's device (None: it takes the GEMVs); attention
    width 0 where there is no output projection."""
    hidden, inner = down.shape
    attn_width = 0 if out_weight is None else out_weight.shape[-1]
    return RegisterPlan.of(hidden, inner, attn_width, x.element_size(), num_sms(x.device))


def gated_mlp_one_row(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    out_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate) * up) of RMSNorm(residual + x), residual stream) for one row x,
    x first projected by `out_weight` (H, attn_width) where given: `ops.gated_mlp`'s
    math in one kernel. The stream is a new tensor (x's projection without a residual;
    x itself without either). Raises ValueError where `plan_for` has no plan."""
    hidden, inner, _ = _check_operands(x, residual, norm_weight, gate_up, down, out_weight)
    plan = plan_for(x, gate_up, down, out_weight)
    if plan is None:
        raise ValueError(
            f"an MLP of hidden {hidden} and inner {inner} does not fit in registers; "
            "use ops.gated_mlp, which takes the GEMVs for it"
        )
    projected = x.new_empty(1, hidden) if out_weight is not None else x
    stream = projected if residual is None else torch.empty_like(residual)
    act = x.new_empty(inner)
    y = x.new_empty(1, hidden)
    barrier = barrier_counter("gated_mlp_one_row", x.device, plan.programs)
    first = OUT_PROJ if out_weight is not None else GATE_UP
    for first_stage, last_stage in stage_launches(tuple(range(first, DOWN + 1)), x.device):
        _gated_mlp_kernel[(plan.programs,)](
            x,
            x if out_weight is None else out_weight,  # never read without HAS_OUT_PROJ
            projected,
            x if residual is None else residual,  # never read without HAS_RESIDUAL
            norm_weight,
            stream,
            gate_up,
            act,
            down,
            y,
            barrier,
            sum(plan.attn_k),
            hidden,
            inner,
            eps,
            HAS_OUT_PROJ=out_weight is not None,
            HAS_RESIDUAL=residual is not None,
            RO1=plan.hidden_rows[0],
            RO2=plan.hidden_rows[1],
            RI1=plan.inner_rows[0],
            RI2=plan.inner_rows[1],
            KA1=max(plan.attn_k[0], 1),  # an arange of 1 where there is no output projection
            KA2=plan.attn_k[1],
            KH1=plan.hidden_k[0],
            KH2=plan.hidden_k[1],
            KI1=plan.inner_k[0],
            KI2=plan.inner_k[1],
            FIRST=first_stage,
            LAST=last_stage,
            num_warps=NUM_WARPS,
            **pdl_launch(x.device),
        )
    return y, stream
