"""A step's input tokens in one kernel: each row's staged id, or, where the host did not
know it yet (asynchronous scheduling), the token the previous step sampled, read from
the device. torch takes four kernels (clamp, gather, compare, where) at the head of
every decode graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid

_BLOCK = 1024


@triton.jit
def _pending_tokens_kernel(
    ids_ptr, sources_ptr, last_ptr, out_ptr, num_rows, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous_grid(USE_PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < num_rows
    sources = tl.load(sources_ptr + rows, mask=valid, other=-1)
    pending = sources >= 0
    staged = tl.load(ids_ptr + rows, mask=valid & ~pending)
    sampled = tl.load(last_ptr + tl.maximum(sources, 0), mask=valid & pending)
    tl.store(out_ptr + rows, tl.where(pending, sampled, staged), mask=valid)


def pending_tokens(
    input_ids: torch.Tensor, sources: torch.Tensor, last_tokens: torch.Tensor
) -> torch.Tensor:
    """`last_tokens[sources]` where `sources` >= 0, else `input_ids` (all (T,), one dtype
    for the two token tensors): a new tensor."""
    if input_ids.shape != sources.shape or input_ids.dim() != 1:
        raise ValueError(
            f"input_ids and sources must be one (T,) shape, got {tuple(input_ids.shape)} "
            f"and {tuple(sources.shape)}"
        )
    if last_tokens.dtype != input_ids.dtype:
        raise ValueError(
            f"last_tokens' dtype {last_tokens.dtype} must be input_ids' ({input_ids.dtype})"
        )
    out = torch.empty_like(input_ids)
    if input_ids.numel():
        _pending_tokens_kernel[(triton.cdiv(input_ids.numel(), _BLOCK),)](
            input_ids,
            sources,
            last_tokens,
            out,
            input_ids.numel(),
            BLOCK=_BLOCK,
            **pdl_launch(input_ids.device),
        )
    return out
