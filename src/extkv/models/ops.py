"""The models' fused ops, and those of the decode step around them (its input tokens,
its logits and greedy tokens), dispatched by device: Triton kernels on CUDA, torch on CPU.

Model code calls one function per fused op; the CPU path (extkv.models.reference)
is also what the kernels are tested against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from extkv.models import reference

# Up to this many rows (a decode step's batch) a CUDA linear streams its weight through
# the Triton GEMV: its tensor-core tile pads x to 16 rows, so up to 16 it still reads W
# once at no extra arithmetic, where cuBLAS's small-M kernels reach ~1-2 TB/s of the
# H200's ~4; past 16 the GEMV would need a second column tile and cuBLAS's GEMMs win.
GEMV_MAX_ROWS = 16
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I), gate then up -> gelu_tanh(gate) * up (T, I): Gemma's activation, in torch
    on every device (two kernels on CUDA; no fused one yet)."""
    return reference.gelu_tanh_and_mul(gate_up)


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Group-wise RMSNorm of y * silu(gate), in gate's dtype. See `reference.gated_rms_norm`."""
    if y.is_cuda:
        from extkv.kernels.norm import gated_rms_norm as gated_rms_norm_triton

        return gated_rms_norm_triton(y, gate, weight, group_size, eps)
    return reference.gated_rms_norm(y, gate, weight, group_size, eps)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x's rows go through the Triton GEMV: a decode step's few low-precision
    rows on CUDA (`GEMV_MAX_ROWS`)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nn.Linear's forward: a decode step's few low-precision rows on CUDA go through the
    weight-streaming GEMV (`GEMV_MAX_ROWS`); everything else, the CPU included, is F.linear."""
    if takes_gemv(x, weight):
        from extkv.kernels.gemv import linear_small_batch

        return linear_small_batch(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear(silu_and_mul(gate_up), weight, bias)`, the activation fused into the GEMV's
    input where the GEMV runs (same bits: one kernel fewer per MLP)."""
    if takes_gemv(gate_up, weight):
        from extkv.kernels.gemv import silu_and_mul_linear_small_batch

        return silu_and_mul_linear_small_batch(gate_up, weight, bias)
    return linear(silu_and_mul(gate_up), weight, bias)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    one_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear of RMSNorm(residual + x), residual stream), the norm fused into the GEMV's
    input where the GEMV runs (one kernel fewer per norm; the stream is then a new tensor,
    not `residual` updated in place). Without a residual the stream starts at x. With
    `one_row` (the attention's qkv, the projection it was measured on), one row whose
    weight fits in registers runs as one kernel (extkv.kernels.norm_linear, unless
    EXTKV_PERSISTENT=0)."""
    if takes_gemv(x, weight):
        if one_row and x.shape[0] == 1 and persistent_decode():
            from extkv.kernels.norm_linear import plan_for, rms_norm_linear_one_row

            operands = (x, residual, norm_weight, weight, bias)
            contiguous = all(t is None or t.is_contiguous() for t in operands)
            if contiguous and plan_for(x, weight) is not None:
                return rms_norm_linear_one_row(x, residual, norm_weight, eps, weight, bias)
        from extkv.kernels.gemv import rms_norm_linear_small_batch

        return rms_norm_linear_small_batch(x, residual, norm_weight, eps, weight, bias)
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, residual = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), residual


def persistent_decode() -> bool:
    """EXTKV_PERSISTENT: whether a CUDA decode step of one sequence runs each layer's MLP
    sublayer (output projection, norm, gate_up, SiLU, down) and its attention's norm +
    qkv projection as kernels with their weights in registers where they fit (1, the default:
    extkv.kernels.gated_mlp, extkv.kernels.norm_linear), or as GEMVs (0). On an H100,
    Qwen3-0.6B's shape, the MLP kernel took a batch-1 step from 1.090 ms to 0.990
    (BENCHMARKS.md, 2026-12-05 session 6). The GEMVs' sums do not
    depend on the rows beside (up to 16), so with 0 a sequence decoded alone is bit for
    bit the sequence decoded in a batch; with 1 a batch of one adds up in another order
    and may differ in the last bits. `gpu-check persistent` measures both."""
    wanted = os.environ.get("EXTKV_PERSISTENT", "1")
    if wanted not in ("0", "1"):
        raise ValueError(
            "EXTKV_PERSISTENT must be 0 (separate GEMVs) or 1 (the one-row kernels), "
            f"got {wanted!r}"
        )
    return wanted == "1"


@dataclass(frozen=True)
class GatedMLPWeights:
    """What a gated MLP (SiLU, no biases) reads besides its input: its norm's weight and
    eps, gate_up (2I, H), gate then up, and down (H, I)."""

    norm: torch.Tensor
    eps: float
    gate_up: torch.Tensor
    down: torch.Tensor


def gated_mlp(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    mlp: GatedMLPWeights,
    out_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate) * up) of RMSNorm(residual + x), residual stream); with `out_weight`
    x is an attention's output, projected by it first (one rank, no bias). One row on
    CUDA whose weights fit in registers runs as one kernel (extkv.kernels.gated_mlp, unless
    EXTKV_PERSISTENT=0); other decode rows take the fused GEMVs."""
    weights = (mlp.gate_up, mlp.down) if out_weight is None else (mlp.gate_up, mlp.down, out_weight)
    gemv = takes_gemv(x, weights[-1]) and all(w.dtype == x.dtype for w in weights)
    if gemv and x.shape[0] == 1 and persistent_decode():
        from extkv.kernels.gated_mlp import gated_mlp_one_row, plan_for

        operands = (
            (x, mlp.norm, *weights) if residual is None else (x, residual, mlp.norm, *weights)
        )
        contiguous = all(t.is_contiguous() for t in operands)
        if contiguous and plan_for(x, mlp.gate_up, mlp.down, out_weight) is not None:
            args = (x, residual, mlp.norm, mlp.eps, mlp.gate_up, mlp.down, out_weight)
            return gated_mlp_one_row(*args)
    if out_weight is not None:
        x = linear(x, out_weight)
    gate_up, residual = rms_norm_linear(x, residual, mlp.norm, mlp.eps, mlp.gate_up)
    return silu_and_mul_linear(gate_up, mlp.down), residual


def pending_tokens(
    input_ids: torch.Tensor, sources: torch.Tensor, last_tokens: torch.Tensor
) -> torch.Tensor:
    """A step's input tokens: `last_tokens[sources]` where `sources` >= 0 (the previous
    step's samples, still on the device), else the staged `input_ids`; one kernel on CUDA."""
    if input_ids.is_cuda:
        from extkv.kernels.pending_tokens import pending_tokens as pending_tokens_triton

        return pending_tokens_triton(input_ids, sources, last_tokens)
    return torch.where(sources >= 0, last_tokens[sources.clamp(min=0)], input_ids)


def store_logits_and_argmax(logits: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor) -> None:
    """out[:] = logits as fp32 and tokens[:] = their greedy tokens (torch.argmax's): one
    kernel on CUDA, the decode graph's last, for torch's three; torch's on the CPU."""
    if logits.is_cuda:
        from extkv.kernels.argmax import logits_and_argmax

        logits_and_argmax(logits, out, tokens)
        return
    out.copy_(logits)
    tokens.copy_(logits.argmax(dim=-1))


def _fused_moe() -> bool:
    """Whether CUDA runs mixture-of-experts layers through the fused kernels (EXTKV_FUSED_MOE,
    default 1) or the reference loop (0: eager only, for comparison)."""
    wanted = os.environ.get("EXTKV_FUSED_MOE", "1")
    if wanted not in ("0", "1"):
        raise ValueError(
            f"EXTKV_FUSED_MOE must be 0 (the reference loop) or 1 (the fused kernels), "
            f"got {wanted!r}"
        )
    return wanted == "1"


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture-of-experts layer's routed experts (plus `shared`, the shared experts'
    output): the fused Triton kernels on CUDA, which CUDA graphs capture; the reference
    loop elsewhere. See `reference.moe_experts`."""
    fused = _fused_moe()  # checked on every device: a bad value fails on the CPU too
    if x.is_cuda and fused:
        from extkv.kernels.fused_moe import fused_experts

        return fused_experts(x, gate_up, down, weights, indices, shared)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "EXTKV_FUSED_MOE=0: the reference mixture-of-experts loop cannot run under CUDA "
            "graph capture (the host decides its shapes); use enforce_eager=True"
        )
    return reference.moe_experts(x, gate_up, down, weights, indices, shared)
