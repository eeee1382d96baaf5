"""The gated MLP's activation, silu(gate) * up, in one kernel instead of three."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid

_BLOCK = 1024


@triton.jit
def silu_times(gate, up, like_ptr):
    """silu(gate) * up of fp32 `gate` and `up`, in the dtype `like_ptr` points to, rounded
    where torch's two ops round (the activation kernel's and the GEMV input's math)."""
    dtype = like_ptr.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (activated * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, inner, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """One program per (row, block of features); rounds where torch's two ops do."""
    wait_for_previous_grid(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < inner
    src = gate_up_ptr + row * stride_in + cols
    gate = tl.load(src, mask=live, other=0.0).to(tl.float32)
    up = tl.load(src + inner, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_times(gate, up, out_ptr), mask=live)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I), gate then up -> silu(gate) * up (T, I) in gate_up's dtype."""
    num_rows, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"silu_and_mul needs (T, 2I) with contiguous columns, got shape {tuple(gate_up.shape)}"
        )
    inner = width // 2
    out = gate_up.new_empty(num_rows, inner)
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(inner, _BLOCK))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            inner,
            BLOCK=_BLOCK,
            num_warps=4,
            **pdl_launch(gate_up.device),
        )
    return out
