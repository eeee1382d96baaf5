"""Mamba2's causal depthwise conv for one decode token per sequence, state updated in place.

The conv state of a sequence is its last `K - 1` inputs (one cache row,
addressed through strides, so page-padded hybrid layouts work unchanged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid


@triton.jit
def _causal_conv_update_kernel(
    x_ptr,
    state_ptr,
    weight_ptr,
    bias_ptr,
    index_ptr,
    carry_ptr,
    out_ptr,
    stride_xs,
    stride_xc,
    stride_sb,
    stride_sc,
    stride_sk,
    stride_wc,
    stride_wk,
    stride_os,
    channels,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (sequence, channel block).

    Each channel is owned by one thread for every column it touches, so the
    state can be shifted in place: column k is read before it is overwritten.
    """
    wait_for_previous_grid(USE_PDL)
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = c < channels
    block = tl.load(index_ptr + seq).to(tl.int64)
    carry = (tl.load(carry_ptr + seq) != 0) & (block >= 0)
    row = state_ptr + block * stride_sb + c * stride_sc

    x = tl.load(x_ptr + seq * stride_xs + c * stride_xc, mask=live, other=0.0).to(tl.float32)
    w_last = tl.load(weight_ptr + c * stride_wc + (WIDTH - 1) * stride_wk, mask=live, other=0.0)
    acc = x * w_last.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=live, other=0.0).to(tl.float32)
    for k in tl.static_range(WIDTH - 1):
        old = tl.load(row + k * stride_sk, mask=live & carry, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + c * stride_wc + k * stride_wk, mask=live, other=0.0)
        acc += old * w.to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + seq * stride_os + c, out.to(out_ptr.dtype.element_ty), mask=live)

    keep = live & (block >= 0)  # a padding row has no state to keep
    for k in tl.static_range(WIDTH - 2):
        later = tl.load(row + (k + 1) * stride_sk, mask=live & carry, other=0.0)
        tl.store(row + k * stride_sk, later, mask=keep)
    tl.store(row + (WIDTH - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=keep)


def causal_conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """silu(conv) of x (S, C), one token per sequence, continuing from and updating
    conv_state (num_blocks, C, K - 1) at rows state_indices (-1: padding, state untouched).

    weight (C, K); rows whose has_initial_state is False start from zeros.
    Returns (S, C) in x's dtype, like `causal_conv_varlen` on a one-token batch.
    """
    num_seqs, channels = x.shape
    out = torch.empty(num_seqs, channels, dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    block_c = min(triton.next_power_of_2(channels), 256)
    _causal_conv_update_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x,
        conv_state,
        weight,
        bias if bias is not None else weight,  # never read without HAS_BIAS
        state_indices,
        has_initial_state,
        out,
        *x.stride(),
        *conv_state.stride(),
        *weight.stride(),
        out.stride(0),
        channels,
        WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None,
        BLOCK_C=block_c,
        **pdl_launch(x.device),
    )
    return out
