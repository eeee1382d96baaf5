"""Building blocks shared by the decoder models.

The math follows Hugging Face's op for op (same dtypes, same order), so fp32
logits agree to rounding and bf16 ones round the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from extkv.models import ops
from extkv.models.parallel import MergedColumnParallelLinear, RowParallelLinear, split_evenly


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), casting dtype."""
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, part: str | None) -> None:
    """How a parameter without a `weight_loader` (neither fused nor sharded) loads: whole, its
    shape checked."""
    copy_weight(param.data, loaded)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back before the weight multiply (as HF does), with
    the residual add of the layer before fused in.

    Decoder layers pass `(hidden, residual)` along (vLLM style): each norm adds the
    previous sublayer's output to the residual stream in place and normalises the sum.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, residual stream): `residual + x` normed, residual updated in place;
        without a residual the stream starts at x."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.rms_norm(x, self.weight, self.eps, residual)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, max_position: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (rotary_dim / 2,) in fp32 on the CPU, where HF computes them too.

    `partial_rotary_factor` (Bamba: 0.5) rotates only the leading
    `rotary_dim = head_dim * factor` channels of each head.
    """
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    theta = params["rope_theta"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        params = {"original_max_position_embeddings": max_position, **params}
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; extkv supports 'default', 'llama3'"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to `max_position`, computed once in fp32.

    `cos_sin_cache` (max_position, rotary_dim): each row the cos then the sin of
    its rotary_dim / 2 frequencies. The attention kernel gathers rows by position
    and rounds them to the model dtype in registers, so a step allocates nothing
    that depends on its positions (CUDA-graph friendly) and never recomputes trig.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(head_dim, max_position, params).to(positions)
        self.register_buffer(
            "cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False
        )


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one matmul; under tensor parallelism
    each rank holds a slice of the intermediate features."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        inner = split_evenly(intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate_proj": [inner], "up_proj": [inner]}, bias
        )
        self.down_proj = RowParallelLinear(inner, hidden_size, bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden_size) -> (down(silu(gate) * up) of `norm(x, residual)`, summed over
        the ranks; the residual stream). Where a decode step's GEMV runs, the norm is fused
        into the gate/up projection and the activation into the down projection."""
        gate_up, residual = self.gate_up_proj.normed(x, residual, norm)
        return self.down_proj(gate_up, gated=True), residual
