"""The models' fused ops, dispatched by device: Triton kernels on CUDA, torch on CPU.

Model code calls one function per fused op; the CPU path (extkv.models.reference)
is also what the kernels are tested against.
"""

from __future__ import annotations

import torch

from extkv.models import reference


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x; with `residual`, `residual += x` in place first and the sum is
    normed: returns (normed, residual). See `reference.rms_norm`."""
    if x.is_cuda:  # Triton is imported on the GPU path only: CPU installs may lack it
        from extkv.kernels.norm import rms_norm as rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I), gate then up -> silu(gate) * up (T, I)."""
    if gate_up.is_cuda:
        from extkv.kernels.activation import silu_and_mul as silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return reference.silu_and_mul(gate_up)


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Group-wise RMSNorm of y * silu(gate), in gate's dtype. See `reference.gated_rms_norm`."""
    if y.is_cuda:
        from extkv.kernels.norm import gated_rms_norm as gated_rms_norm_triton

        return gated_rms_norm_triton(y, gate, weight, group_size, eps)
    return reference.gated_rms_norm(y, gate, weight, group_size, eps)
