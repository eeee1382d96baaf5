"""Mamba2's causal depthwise conv, the conv states read and written in their cache rows:
one decode token per sequence (state shifted in place), or a prefill's sequences.

The conv state of a sequence is its last `K - 1` inputs (one cache row,
addressed through strides, so page-padded hybrid layouts work unchanged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid
from extkv.kernels.ssd_prefill import ChunkLayout


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


@triton.jit
def _causal_conv_prefill_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    index_ptr,
    carry_ptr,
    out_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    chunk_seq_ptr,
    chunk_offset_ptr,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_sb,
    stride_sc,
    stride_sk,
    stride_ot,
    channels,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (chunk, channel block): each token's window of WIDTH inputs, the
    ones before its sequence's first token read from the sequence's conv state."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_live = c < channels
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    offset = tl.load(chunk_offset_ptr + chunk)  # of the chunk's first token in its sequence
    bias = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=c_live, other=0.0).to(tl.float32)
    if HAS_STATE:
        seq = tl.load(chunk_seq_ptr + chunk)
        block = tl.load(index_ptr + seq).to(tl.int64)
        carry = (tl.load(carry_ptr + seq) != 0) & (block >= 0)
    for lo in range(0, CHUNK, BLOCK_T):
        t = lo + tl.arange(0, BLOCK_T)
        t_live = t < length
        inside = t_live[:, None] & c_live[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32) + bias[None, :]
        for k in tl.static_range(WIDTH):
            back = WIDTH - 1 - k  # how many tokens before this one the tap reads
            pos = offset + t - back  # in the sequence; < 0: in the conv state
            value = tl.load(
                x_ptr + (start + t - back)[:, None] * stride_xt + c[None, :] * stride_xc,
                mask=inside & (pos >= 0)[:, None],
                other=0.0,
            ).to(tl.float32)
            if HAS_STATE:
                earlier = tl.load(
                    state_ptr
                    + block * stride_sb
                    + c[None, :] * stride_sc
                    + (WIDTH - 1 + pos)[:, None] * stride_sk,
                    mask=inside & (pos < 0)[:, None] & carry,
                    other=0.0,
                ).to(tl.float32)
                value += earlier
            w = tl.load(weight_ptr + c * stride_wc + k * stride_wk, mask=c_live, other=0.0)
            acc += value * w.to(tl.float32)[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + (start + t)[:, None] * stride_ot + c[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=inside,
        )


@triton.jit
def _conv_state_store_kernel(
    x_ptr,
    state_ptr,
    index_ptr,
    carry_ptr,
    cu_ptr,
    stride_xt,
    stride_xc,
    stride_sb,
    stride_sc,
    stride_sk,
    channels,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program per (sequence, channel block): the sequence's last WIDTH - 1 inputs
    to its conv state row, reaching back into the old state where it is shorter."""
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_live = c < channels
    block = tl.load(index_ptr + seq).to(tl.int64)
    carry = (tl.load(carry_ptr + seq) != 0) & (block >= 0)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1) - start
    row = state_ptr + block * stride_sb + c * stride_sc
    # Column j takes old column j + length (> j) at most: read before it is overwritten.
    for j in tl.static_range(WIDTH - 1):
        pos = length - (WIDTH - 1) + j  # in the sequence; < 0: in the old state
        new = tl.load(x_ptr + (start + pos) * stride_xt + c * stride_xc, mask=c_live & (pos >= 0))
        old = tl.load(row + (WIDTH - 1 + pos) * stride_sk, mask=c_live & (pos < 0) & carry)
        value = tl.where(pos >= 0, new.to(tl.float32), tl.where(carry, old.to(tl.float32), 0.0))
        tl.store(
            row + j * stride_sk, value.to(state_ptr.dtype.element_ty), mask=c_live & (block >= 0)
        )


def causal_conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layout: ChunkLayout,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv_varlen` in two kernels, the states in the cache: silu(conv) of x
    (T, C) per sequence (`layout`'s chunks, `cu_seqlens` int32 on the device), in x's
    dtype. Sequence s continues from row `state_indices[s]` of conv_state
    (num_blocks, C, K - 1) where `has_initial_state[s]` (zeros otherwise) and leaves its
    last K - 1 inputs there (-1: a padding row, not written); without `conv_state`
    every sequence starts from zeros and nothing is kept."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    block_c = min(triton.next_power_of_2(channels), 128)
    has_state = conv_state is not None
    state = (conv_state, state_indices, has_initial_state) if has_state else (x, x, x)
    state_strides = conv_state.stride() if has_state else (0, 0, 0)
    if layout.num_chunks:
        _causal_conv_prefill_kernel[(layout.num_chunks, triton.cdiv(channels, block_c))](
            x, weight, bias if bias is not None else weight, *state, out,
            layout.starts, layout.lengths, layout.seqs, layout.offsets,
            *x.stride(), *weight.stride(), *state_strides, out.stride(0), channels,
            WIDTH=width, HAS_BIAS=bias is not None, HAS_STATE=has_state, CHUNK=layout.chunk,
            BLOCK_T=min(32, layout.chunk), BLOCK_C=block_c,
        )  # fmt: skip
    if has_state:
        _conv_state_store_kernel[(layout.num_seqs, triton.cdiv(channels, block_c))](
            x, *state, cu_seqlens, *x.stride(), *state_strides, channels,
            WIDTH=width, BLOCK_C=block_c,
        )  # fmt: skip
    return out
