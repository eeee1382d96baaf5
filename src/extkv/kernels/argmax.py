"""The decode graph's last step in one kernel: the logits copied out as fp32 and each
row's greedy token, where torch takes three kernels (copy, argmax, copy) and its
argmax reduces a 150k vocabulary with a few dozen programs.

Each program takes a block of one row's vocabulary, stores it and leaves the block's
maximum and its first column; the last program of the row to arrive (an arrival
counter) combines the row's blocks in column order. The token is torch.argmax's:
the first column of the maximum, or of the first NaN where there is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.arrivals import arrival_counters
from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid

_BLOCK = 4096  # vocabulary columns per program


@triton.jit
def _first_max(values, columns, valid, no_column):
    """(the maximum of `values` where `valid`, NaN if any is NaN; the least of `columns`
    where it is), `no_column` where nothing is valid."""
    is_nan = (values != values) & valid
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(valid & ~is_nan, values, -float("inf")), axis=0)
    hits = tl.where(any_nan, is_nan, valid & (values == best))
    first = tl.min(tl.where(hits, columns, no_column), axis=0)
    return tl.where(any_nan, float("nan"), best), first


@triton.jit
def _logits_argmax_kernel(
    logits_ptr,
    out_ptr,
    tokens_ptr,
    block_max_ptr,
    block_column_ptr,
    arrivals_ptr,
    vocab,
    stride_logits,
    stride_out,
    BLOCK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_grid(USE_PDL)
    row = tl.program_id(0)
    block = tl.program_id(1)
    columns = block * BLOCK + tl.arange(0, BLOCK)
    valid = columns < vocab
    values = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + columns, mask=valid)
    values = values.to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + columns, values, mask=valid)
    best, first = _first_max(values, columns, valid, vocab)
    slot = row * NUM_BLOCKS + block
    tl.store(block_max_ptr + slot, best, cache_modifier=".wt")
    tl.store(block_column_ptr + slot, first, cache_modifier=".wt")
    tl.debug_barrier()  # the block's result is written before it counts as arrived
    if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel") == NUM_BLOCKS - 1:
        blocks = tl.arange(0, BLOCKS_POW2)
        mine = blocks < NUM_BLOCKS
        maxima = tl.load(block_max_ptr + row * NUM_BLOCKS + blocks, mask=mine, cache_modifier=".cv")
        firsts = tl.load(
            block_column_ptr + row * NUM_BLOCKS + blocks, mask=mine, cache_modifier=".cv"
        )
        # Each block's column is its first maximum and blocks are in column order, so the
        # first column among the blocks that reach the row's maximum is the row's first.
        _, token = _first_max(maxima, firsts, mine, vocab)
        tl.store(tokens_ptr + row, token.to(tokens_ptr.dtype.element_ty))
        tl.atomic_xchg(arrivals_ptr + row, 0)  # ready for the next call


def logits_and_argmax(logits: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor) -> None:
    """out[:] = logits as fp32 and tokens[:] = logits.argmax(-1), for logits (rows, vocab)
    of fp32, bf16 or fp16, out (rows, vocab) fp32 and tokens (rows,) integer: bit for bit
    what the copy and torch.argmax give. Allocates only the blocks' scratch, so it can be
    captured in a CUDA graph (after one call outside it, as every Triton kernel)."""
    rows, vocab = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if out.shape != logits.shape or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(
            f"out must be fp32 of logits' shape {tuple(logits.shape)} with contiguous rows, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if tokens.shape != (rows,) or tokens.dtype.is_floating_point or tokens.stride(0) != 1:
        raise ValueError(
            f"tokens must be contiguous integers of shape ({rows},), got {tokens.dtype} "
            f"{tuple(tokens.shape)}"
        )
    if logits.stride(1) != 1:
        raise ValueError("logits needs contiguous rows (stride(1) == 1)")
    if not (rows and vocab):
        return
    num_blocks = triton.cdiv(vocab, _BLOCK)
    scratch_max = torch.empty(rows * num_blocks, dtype=torch.float32, device=logits.device)
    scratch_column = torch.empty(rows * num_blocks, dtype=torch.int32, device=logits.device)
    _logits_argmax_kernel[(rows, num_blocks)](
        logits,
        out,
        tokens,
        scratch_max,
        scratch_column,
        arrival_counters("logits_and_argmax", logits.device, rows),
        vocab,
        logits.stride(0),
        out.stride(0),
        BLOCK=_BLOCK,
        NUM_BLOCKS=num_blocks,
        BLOCKS_POW2=triton.next_power_of_2(num_blocks),
        num_warps=8,
        **pdl_launch(logits.device),
    )
