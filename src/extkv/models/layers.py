"""Building blocks shared by the decoder models.

The math follows Hugging Face's op for op (same dtypes, same order), so fp32
logits agree to rounding and bf16 ones round the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from extkv.models.parallel import MergedColumnParallelLinear, RowParallelLinear, split_evenly


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), casting dtype."""
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, part: str | None) -> None:
    copy_weight(param.data, loaded)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back before the weight multiply (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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

    A step only gathers rows, so it allocates nothing that depends on the
    step's positions (CUDA-graph friendly) and never recomputes trig.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(head_dim, max_position, params).to(positions)
        self.register_buffer(
            "cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, 1, rotary_dim / 2) in `dtype`, broadcasting over heads."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, head_dim) in halves: HF's `x*cos + rotate_half(x)*sin`.

    Only the leading `2 * cos.shape[-1]` channels rotate; with partial rotary
    the rest pass through unchanged, as HF does.
    """
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), dim=-1)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
