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


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor, part: str | None) -> None:
    copy_weight(param.data, loaded.float() + 1.0)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x * (1 + w) in fp32: the checkpoint's w is loaded plus one, so the
    Llama norm (and the kernels it fuses into) computes it; exact in fp32, one rounding of
    1 + w in bf16."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight.weight_loader = _load_plus_one


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(params: dict[str, Any], max_position: int) -> float:
    """The context stretch: `factor`, else (DeepSeek-V3 style configs) the ratio of the
    context to the pretraining one."""
    return params.get("factor") or max_position / params.get(
        "original_max_position_embeddings", max_position
    )


def _yarn_inv_freq(
    pos_freqs: torch.Tensor, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the pretraining context
    are interpolated (divided by the factor), those turning more than `beta_fast` times
    kept, a linear ramp between; cos/sin are scaled by the attention factor."""
    factor = _yarn_factor(params, max_position)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = _yarn_mscale(factor)
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    rotary_dim, theta = 2 * pos_freqs.numel(), params["rope_theta"]
    old_context = params.get("original_max_position_embeddings", max_position)

    def dim_turning(turns: float) -> float:  # the dim whose frequency turns `turns` times
        return rotary_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = (
        dim_turning(params.get("beta_fast") or 32),
        dim_turning(params.get("beta_slow") or 1),
    )
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu")
    ramp = (ramp - low) / (high - low)
    kept = 1 - ramp.clamp(0, 1)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept
    return inv_freq, float(attention_factor)


def rope_frequencies(
    head_dim: int, max_position: int, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rotary_dim / 2,) in fp32 on the CPU, where HF computes them too,
    and the factor cos and sin are scaled by (YaRN's attention factor; 1 otherwise).

    `partial_rotary_factor` (Bamba: 0.5) rotates only the leading
    `rotary_dim = head_dim * factor` channels of each head.
    """
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    theta = params["rope_theta"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
    pos_freqs = theta**exponents
    inv_freq = 1.0 / pos_freqs
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":
        params = {"original_max_position_embeddings": max_position, **params}
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "linear":  # positions slowed down by `factor` (Gemma 3's global layers)
        return inv_freq / params["factor"], 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(pos_freqs, params, max_position)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; extkv supports 'default', 'linear', "
        "'llama3', 'yarn'"
    )


def mla_softmax_scale(qk_head_dim: int, params: dict[str, Any], max_position: int) -> float:
    """DeepSeek's softmax scale: 1/sqrt(qk_head_dim), times YaRN's `mscale_all_dim`
    correction squared when the rope is scaled (it scales the non-rotary dims too)."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        mscale = _yarn_mscale(_yarn_factor(params, max_position), mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to `max_position`, computed once in fp32 (YaRN: both
    scaled by its attention factor, as HF does).

    `cos_sin_cache` (max_position, rotary_dim): each row the cos then the sin of
    its rotary_dim / 2 frequencies. The attention kernel gathers rows by position
    and rounds them to the model dtype in registers, so a step allocates nothing
    that depends on its positions (CUDA-graph friendly) and never recomputes trig.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32)
        inv_freq, scale = rope_frequencies(head_dim, max_position, params)
        freqs = positions[:, None] * inv_freq.to(positions)
        cos_sin = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)


class GatedMLP(nn.Module):
    """Gated MLP (SiLU, or Gemma's GELU-tanh) with gate and up fused into one matmul; under
    tensor parallelism each rank holds a slice of the intermediate features."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, activation: str = "silu"
    ) -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        self.activation = activation
        inner = split_evenly(intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate_proj": [inner], "up_proj": [inner]}, bias
        )
        self.down_proj = RowParallelLinear(inner, hidden_size, bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden_size) -> (down(act(gate) * up) of `norm(x, residual)`, summed over
        the ranks; the residual stream). Where a decode step's GEMV runs, the norm is fused
        into the gate/up projection and SiLU into the down projection; without biases the
        two run as one op (`ops.gated_mlp`: one kernel for one row)."""
        if self._one_kernel():
            y, residual = ops.gated_mlp(x, residual, self._weights(norm))
            return self.down_proj.tp.all_reduce(y), residual
        gate_up, residual = self.gate_up_proj.normed(x, residual, norm)
        if self.activation == "gelu_tanh":
            return self.down_proj(ops.gelu_tanh_and_mul(gate_up)), residual
        return self.down_proj(gate_up, gated=True), residual

    def after_projection(
        self,
        attn: torch.Tensor,
        out_proj: RowParallelLinear,
        residual: torch.Tensor | None,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of `out_proj(attn)`: an attention's output projection and this MLP in
        one op where they can be (`ops.gated_mlp`: one rank, no biases)."""
        if self._one_kernel() and out_proj.tp.size == 1 and out_proj.bias is None:
            weights = self._weights(norm)
            return ops.gated_mlp(attn, residual, weights, out_proj.weight)
        return self(out_proj(attn), residual, norm)

    def _one_kernel(self) -> bool:
        """Whether the MLP runs as one op (`ops.gated_mlp`): SiLU, no biases."""
        no_bias = self.gate_up_proj.bias is None and self.down_proj.bias is None
        return self.activation == "silu" and no_bias

    def _weights(self, norm: RMSNorm) -> ops.GatedMLPWeights:
        return ops.GatedMLPWeights(
            norm.weight, norm.eps, self.gate_up_proj.weight, self.down_proj.weight
        )

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of x as it is, no norm before, and this rank's share of it
        only: a mixture-of-experts layer's shared experts, which take the rows the layer's
        one norm produced and whose shares the layer sums with its routed experts' in one
        all-reduce."""
        return self.down_proj(self.gate_up_proj(x), gated=True, reduce=False)
