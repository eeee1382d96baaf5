"""The fused ops in plain torch: the CPU path and the Triton kernels' oracle.

Op for op what Hugging Face computes (same dtypes, same order), so fp32 outputs
equal transformers' and bf16 ones round the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from extkv.attention.reference import store_kv_reference


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in fp32, cast back to x's dtype before the weight multiply (as HF does).

    With `residual`: first `residual += x` in place, then normalise that sum (cast
    to x's dtype: a residual stream kept in fp32 is normed in the model dtype, as
    HF's Mamba2 blocks do); returns (normed, residual).
    """
    if residual is not None:
        x = residual.add_(x).to(x.dtype)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(dtype)
    return normed if residual is None else (normed, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I), gate then up -> silu(gate) * up (T, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one (T, I) tensor fewer to allocate and fill


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I), gate then up -> gelu(gate, tanh approximation) * up (T, I), as
    transformers' `gelu_pytorch_tanh`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture-of-experts layer's output for x (T, H): each token's rows of its experts
    `indices` (T, top_k), scaled by `weights` (T, top_k), summed; plus `shared` (T, H), the
    shared experts' output, when given. gate_up (E, 2I, H) and down (E, H, I) stack the
    experts' weights. As transformers: one expert after another in ascending order, each
    added into the output in x's dtype (the host learns which experts are hit: no CUDA
    graph can capture this)."""
    out = torch.zeros_like(x)
    for expert in indices.unique().tolist():
        token, slot = (indices == expert).nonzero(as_tuple=True)
        activated = silu_and_mul(F.linear(x[token], gate_up[expert]))
        rows = F.linear(activated, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, rows.to(out.dtype))
    return out if shared is None else out + shared


def gated_rms_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """RMSNorm of y * silu(gate) within each group of `group_size` channels (HF's
    `MambaRMSNormGated`), in fp32; the result takes gate's (the model's) dtype."""
    h = (y.float() * F.silu(gate.float())).unflatten(-1, (-1, group_size))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.flatten(-2)).to(gate.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, head_dim) in halves: HF's `x*cos + rotate_half(x)*sin`.

    Only the leading `2 * cos.shape[-1]` channels rotate; with partial rotary
    the rest pass through unchanged, as HF does.
    """
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    # Each half computed into its place in the output (no cat pass over the whole): the
    # same values, rounded as HF's. The output is contiguous in x's shape, whatever x's
    # strides (`_rotated_head_major` relies on it).
    out = torch.empty(x.shape, dtype=torch.result_type(x, cos), device=x.device)
    out1, out2 = out[..., :rotary_dim].chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (T, (Hq + 2 Hkv) * D) -> q (T, Hq, D), k, v (T, Hkv, D): q and k normed per
    head (when weights are given) and rotated with the cos/sin rows of `positions`."""
    qkv = qkv.unflatten(-1, (num_q_heads + 2 * num_kv_heads, -1))
    cos, sin = cos_sin_cache[positions].to(qkv.dtype).chunk(2, dim=-1)
    if q_norm_weight is None:  # q and k rotated together: half the ops (the same values)
        qk = _rotated_head_major(qkv[:, : num_q_heads + num_kv_heads], cos, sin)
        return qk[:, :num_q_heads], qk[:, num_q_heads:], qkv[:, num_q_heads + num_kv_heads :]
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    return _rotated_head_major(q, cos, sin), _rotated_head_major(k, cos, sin), v


def _rotated_head_major(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` of x (T, heads, D) with cos/sin (T, rotary_dim / 2), its result laid
    out head by head (a (T, heads, D) view of (heads, T, D) memory): the layout the CPU's
    flash kernel reads fastest, at no cost here (the rotation writes a new tensor anyway)."""
    return apply_rotary(x.transpose(0, 1), cos, sin).transpose(0, 1)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`qk_norm_rope`, k and v written to the caches at slot_mapping (-1 skips); returns q."""
    q, k, v = qk_norm_rope(
        qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps
    )
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    return q
