"""RMSNorm kernels: the residual add fused into the norm, and Mamba2's gated group norm.

In torch each is a chain of small ops (casts, pow, mean, rsqrt, muls, the
residual add); here each is one pass over the row. The rounding follows Hugging
Face's op order (fp32 inside, cast back to the input dtype before the weight
multiply), so bf16 results round as HF's do up to the order of the sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


@triton.jit
def weighted_rms(xf, rstd, weight, like_ptr):
    """weight * (xf * rstd), fp32 in, in the dtype `like_ptr` points to, the normed value
    rounded to it before the weight multiply as HF's RMSNorm does (the norm kernel's and
    the GEMV input's math)."""
    dtype = like_ptr.dtype.element_ty
    return (weight * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per row: optionally residual += x, then normalise the sum."""
    wait_for_previous_grid(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * stride_r + cols
        total = tl.load(residual_row, mask=live, other=0.0).to(tl.float32) + x.to(tl.float32)
        total = total.to(residual_ptr.dtype.element_ty)
        tl.store(residual_row, total, mask=live)
        x = total.to(x_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, weighted_rms(xf, rstd, weight, out_ptr), mask=live)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (T, H) in x's dtype; with `residual` (T, H), first `residual += x`
    in place (in residual's dtype, which may be fp32) and normalise that sum, cast to
    x's dtype. Returns the normed rows, or (normed, residual) when residual is given.
    """
    num_rows, num_cols = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows with contiguous columns (stride(1) == 1)")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows:
        block = triton.next_power_of_2(num_cols)
        _rms_norm_kernel[(num_rows,)](
            x,
            x if residual is None else residual,  # never read without HAS_RESIDUAL
            weight,
            out,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            out.stride(0),
            num_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
            **pdl_launch(x.device),
        )
    return out if residual is None else (out, residual)


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    stride_y,
    stride_g,
    stride_o,
    group_size,
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (row, channel group): normalise y * silu(gate) within the group."""
    wait_for_previous_grid(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    live = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + row * stride_y + cols, mask=live, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=live, other=0.0).to(tl.float32)
    h = y * (gate / (1.0 + tl.exp(-gate)))
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / group_size + eps)
    weight = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
    out = weight * (h * rstd)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=live)


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """RMSNorm of y * silu(gate) (T, dim) within each group of `group_size` channels,
    all in fp32, times weight; the result takes gate's dtype (Mamba2's mixer output)."""
    num_rows, dim = y.shape
    if y.stride(1) != 1 or gate.stride(1) != 1:
        raise ValueError("gated_rms_norm needs rows with contiguous columns (stride(1) == 1)")
    if dim % group_size:
        raise ValueError(f"group_size {group_size} must divide the channels ({dim})")
    out = torch.empty(num_rows, dim, dtype=gate.dtype, device=y.device)
    if num_rows:
        block = triton.next_power_of_2(group_size)
        _gated_rms_norm_kernel[(num_rows, dim // group_size)](
            y,
            gate,
            weight,
            out,
            y.stride(0),
            gate.stride(0),
            out.stride(0),
            group_size,
            eps,
            BLOCK=block,
            num_warps=_num_warps(block),
            **pdl_launch(y.device),
        )
    return out
