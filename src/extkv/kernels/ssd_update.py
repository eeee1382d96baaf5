"""Mamba2's SSM state update for one decode token per sequence, in place.

Decode of a Mamba layer is bound by reading and writing the SSM state
(H * P * N fp32 per sequence); this kernel touches it once each way, with the
time-step discretisation fused in, where torch would gather, update and scatter
it in several passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid

_TILE_ELEMENTS = 4096  # state elements per program: (BLOCK_P, N) in registers


@triton.jit
def _ssm_state_update_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    dt_bias_ptr,
    a_log_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    index_ptr,
    carry_ptr,
    out_ptr,
    stride_sb,
    stride_sh,
    stride_sp,
    stride_sn,
    stride_xs,
    stride_xh,
    stride_xp,
    stride_dts,
    stride_dth,
    stride_bs,
    stride_bg,
    stride_bn,
    stride_cs,
    stride_cg,
    stride_cn,
    stride_os,
    stride_oh,
    dt_min,
    dt_max,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (sequence, head, block of head channels)."""
    wait_for_previous_grid(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_live = p < HEAD_DIM
    n_live = n < STATE_SIZE
    block = tl.load(index_ptr + seq).to(tl.int64)
    carry = (tl.load(carry_ptr + seq) != 0) & (block >= 0)

    dt = tl.load(dt_ptr + seq * stride_dts + head * stride_dth).to(tl.float32)
    dt += tl.load(dt_bias_ptr + head).to(tl.float32)
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus, as torch's threshold
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * dt)

    group = head // HEADS_PER_GROUP
    # Zeros past N matter: y sums the whole (padded) state row.
    B = tl.load(b_ptr + seq * stride_bs + group * stride_bg + n * stride_bn, mask=n_live, other=0.0)
    C = tl.load(c_ptr + seq * stride_cs + group * stride_cg + n * stride_cn, mask=n_live, other=0.0)
    x = tl.load(x_ptr + seq * stride_xs + head * stride_xh + p * stride_xp, mask=p_live, other=0.0)
    x = x.to(tl.float32)

    tile = p_live[:, None] & n_live[None, :]
    cell = block * stride_sb + head * stride_sh + p[:, None] * stride_sp + n[None, :] * stride_sn
    state = tl.load(state_ptr + cell, mask=tile & carry, other=0.0).to(tl.float32)
    state = state * decay + (dt * x)[:, None] * B.to(tl.float32)[None, :]
    y = tl.sum(state * C.to(tl.float32)[None, :], axis=1)
    y += tl.load(d_ptr + head).to(tl.float32) * x
    tl.store(out_ptr + seq * stride_os + head * stride_oh + p, y, mask=p_live)
    tl.store(state_ptr + cell, state.to(state_ptr.dtype.element_ty), mask=tile & (block >= 0))


def ssm_state_update(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    time_step_limit: tuple[float, float],
) -> torch.Tensor:
    """y (S, H, P) in fp32 for one token per sequence, updating ssm_state
    (num_blocks, H, P, N) at rows state_indices (-1: padding, state untouched).

    x (S, H, P); dt (S, H) before bias and softplus; B, C (S, G, N); A = -exp(A_log).
    Rows whose has_initial_state is False start from zeros. Same math as
    `time_step` + `ssm_step`.
    """
    num_seqs, num_heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=x.device)
    if num_seqs == 0:
        return out
    block_n = triton.next_power_of_2(state_size)
    block_p = max(1, min(triton.next_power_of_2(head_dim), _TILE_ELEMENTS // block_n))
    _ssm_state_update_kernel[(num_seqs, num_heads, triton.cdiv(head_dim, block_p))](
        ssm_state,
        x,
        dt,
        dt_bias,
        A_log,
        B,
        C,
        D,
        state_indices,
        has_initial_state,
        out,
        *ssm_state.stride(),
        *x.stride(),
        *dt.stride(),
        *B.stride(),
        *C.stride(),
        *out.stride()[:2],
        float(time_step_limit[0]),
        float(time_step_limit[1]),
        HEADS_PER_GROUP=num_heads // groups,
        HEAD_DIM=head_dim,
        STATE_SIZE=state_size,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        **pdl_launch(x.device),
    )
    return out
