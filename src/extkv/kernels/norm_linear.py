"""A batch-1 decode step's RMSNorm + linear (the qkv projection) in one kernel whose
weight slices wait in registers.

The GEMV (extkv.kernels.gemv) streams its weight once the kernel before has ended, and
before a layer's qkv projection comes the MLP kernel (extkv.kernels.gated_mlp), which
holds every SM's registers to its end: the qkv GEMV could neither start beside it nor
warm L2 ahead. %globaltimer stamps in each program (H100, Qwen3-0.6B's shape,
BENCHMARKS.md 2026-12-06 session 9) put its norm's rstd 2.0 us after its wait and its
last tile 7.7 us after: 8.5 of a 26.6 us layer. Here each of up to one program per SM
loads its rows of the weight into registers, then waits for the kernel before, then
reads the row once, norms it and reduces: the weight streams at once, over every SM,
with no pipeline of tiles behind the wait. (Its programs too start only as the MLP
kernel's leave: the stamps put its end 6.4 us after the MLP's, BENCHMARKS.md.)

The sums run in another order than the GEMV's tiles, so y may differ from the GEMV's in
the last bits (as the MLP kernel's do: `ops.persistent_decode`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from extkv.kernels.gemv import num_sms
from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid
from extkv.kernels.register_slices import (
    check_normed_row,
    load_rows,
    load_slice,
    load_vector,
    matvec,
    rms_normed_row,
    store_rows,
    two_powers,
)

# Weight bytes a program may hold: up to 96 registers a thread of 8 warps (Qwen3-0.6B's
# qkv takes 64: 4096 x 1024 bf16 over 128 programs); the rest stay for the kernels
# beside it. And at least half the SMs must get a program: fewer stream the weight
# slower than the GEMV's tiles.
MAX_SLICE_BYTES = 96 * 1024
NUM_WARPS = 8


@dataclass(frozen=True)
class RowPlan:
    """How `rms_norm_linear_one_row` cuts a weight: `programs` programs of `rows` rows
    each, rows and K each in two powers of two (the second 0 where one does)."""

    programs: int
    rows: tuple[int, int]
    k: tuple[int, int]

    @classmethod
    @functools.cache
    def of(cls, n: int, k: int, itemsize: int, sms: int) -> RowPlan | None:
        """The plan with the most programs (<= `sms`, >= half of them) that splits the
        rows evenly and whose slices fit `MAX_SLICE_BYTES`; None if there is none."""
        ks = two_powers(k)
        if ks is None:
            return None
        for programs in range(min(sms, n), (sms + 1) // 2 - 1, -1):
            rows = two_powers(n // programs) if n % programs == 0 else None
            if rows is None:
                continue
            if n // programs * k * itemsize > MAX_SLICE_BYTES:
                return None  # fewer programs only make the slices larger
            return cls(programs, rows, ks)
        return None


@triton.jit
def _norm_linear_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    stream_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    k,
    eps,
    OWN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    R1: tl.constexpr,
    R2: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p: rows p * (R1 + R2) ... of y = W @ RMSNorm(residual + x) (+ bias), and
    elements p * OWN ... of the stream residual + x. Everything that is no activation
    (weight, norm weight, bias) is loaded before the wait."""
    pid = tl.program_id(0)
    row0 = pid * (R1 + R2)
    w11, w12, w21, w22 = load_slice(w_ptr, row0, k, R1, R2, K1, K2)
    nw1, nw2 = load_vector(norm_weight_ptr, K1, K2)
    if HAS_BIAS:
        b1, b2 = load_rows(bias_ptr, row0, R1, R2)
    wait_for_previous_grid(USE_PDL)

    n1, n2 = rms_normed_row(
        x_ptr, residual_ptr, stream_ptr, nw1.to(tl.float32), nw2.to(tl.float32),
        pid * OWN, pid * OWN + OWN, k, eps, HAS_RESIDUAL, K1, K2,
    )  # fmt: skip
    y1, y2 = matvec(w11, w12, w21, w22, n1, n2)
    if HAS_BIAS:  # added in fp32 before the one rounding, as the GEMV does
        y1 += b1
        y2 += b2
    store_rows(y_ptr, row0, y1, y2, R1, R2)


def plan_for(x: torch.Tensor, weight: torch.Tensor) -> RowPlan | None:
    """The register plan of `weight` (N, K) on x's device; None: it takes the GEMV."""
    n, k = weight.shape
    return RowPlan.of(n, k, weight.element_size(), num_sms(x.device))


def rms_norm_linear_one_row(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x) @ weight^T + bias, residual stream) for one row x (1, K):
    `extkv.kernels.gemv.rms_norm_linear_small_batch`'s math in one program per slice of
    rows. The stream is a new tensor (x itself without a residual). Raises ValueError
    naming the operand that is off, or where `plan_for` has no plan (see `RowPlan.of`)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be (N, K), got {tuple(weight.shape)}")
    n, k = weight.shape
    check_normed_row(x, k, residual, norm_weight, k)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be ({n},), got {tuple(bias.shape)}")
    operands = [t for t in (x, residual, norm_weight, weight, bias) if t is not None]
    if not all(t.is_contiguous() for t in operands):
        raise ValueError("rms_norm_linear_one_row needs contiguous operands")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight's dtype {weight.dtype} must be x's ({x.dtype})")
    plan = plan_for(x, weight)
    if plan is None:
        raise ValueError(
            f"a weight of {n} x {k} does not fit in registers (K in two powers of two, "
            "rows evenly over at least half the SMs, at most MAX_SLICE_BYTES a program); use "
            "extkv.kernels.gemv.rms_norm_linear_small_batch"
        )
    stream = x if residual is None else torch.empty_like(residual)
    y = x.new_empty(1, n)
    _norm_linear_kernel[(plan.programs,)](
        x,
        x if residual is None else residual,  # never read without HAS_RESIDUAL
        norm_weight,
        stream,
        weight,
        weight if bias is None else bias,  # never read without HAS_BIAS
        y,
        k,
        eps,
        OWN=triton.cdiv(k, plan.programs),
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        R1=plan.rows[0],
        R2=plan.rows[1],
        K1=plan.k[0],
        K2=plan.k[1],
        num_warps=NUM_WARPS,
        **pdl_launch(x.device),
    )
    return y, stream
