"""Mamba2 math in plain torch over flat, variable-length batches.

A batch is every sequence's new tokens concatenated (`cu_seqlens` marks the
boundaries), each sequence continuing from its own initial state (zeros for a
new request). These functions are the CPU path, the prefill path on every
device, and the oracle of the Triton decode kernels. They compute in fp32
whatever the model dtype, as the mamba_ssm kernels do.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Elements of one (chunks, heads, chunk, chunk) intermediate of the intra-chunk step:
# chunks are processed in groups under this bound so a step of many short sequences
# does not allocate gigabytes at once (256 MiB in fp32).
_INTRA_CHUNK_ELEMENTS = 1 << 26


def time_step(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """Discretisation step softplus(dt + dt_bias) clamped to `limit`, in fp32: dt (T, H)."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(*limit)


def causal_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of each sequence, continuing from its conv state.

    x (T, C); weight (C, K); initial_state (S, C, K - 1): the K - 1 inputs that
    precede each sequence. Returns the output (T, C) in x's dtype and the final
    states (S, C, K - 1): each sequence's last K - 1 inputs, reaching back into
    its initial state where it is shorter than that.

    Each sequence's state is laid in front of its tokens in one extended buffer,
    so every output is a window of K consecutive rows. Index arithmetic only (no
    host syncs, shapes fixed by T and S): the same code serves a decode step.
    """
    num_tokens, channels = x.shape
    num_seqs, width = initial_state.shape[0], weight.shape[1] - 1
    device = x.device
    cu = cu_seqlens.long()
    tokens = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)
    ext = x.new_empty(num_tokens + num_seqs * width, channels)
    ext[tokens + (seq + 1) * width] = x
    state_rows = (cu[:-1] + torch.arange(num_seqs, device=device) * width)[:, None]
    state_rows = state_rows + torch.arange(width, device=device)
    ext[state_rows.flatten()] = initial_state.transpose(1, 2).flatten(0, 1).to(x.dtype)
    windows = ext[(tokens + seq * width)[:, None] + torch.arange(width + 1, device=device)]
    out = torch.einsum("tkc,ck->tc", windows.float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    final = ext[state_rows + (cu[1:] - cu[:-1])[:, None]]
    return F.silu(out).to(x.dtype), final.transpose(1, 2)


def _split_heads(t: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(T, H, ...) -> (T, G, H / G, ...) in fp32: head h reads B and C of group h // (H / G)."""
    return t.float().unflatten(1, (num_groups, -1))


def ssm_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: h' = exp(dt A) h + dt x B^T, y = h' C + D x.

    state (S, H, P, N); x (S, H, P); dt (S, H) from `time_step`; A, D (H,);
    B, C (S, G, N). Returns y (S, H, P) and the new state, both fp32.
    """
    groups = B.shape[1]
    x = _split_heads(x, groups)  # (s, g, j, p)
    decay = _split_heads(torch.exp(dt * A), groups)[..., None, None]
    inflow = (_split_heads(dt, groups)[..., None] * x)[..., None] * B.float()[:, :, None, None]
    new = _split_heads(state, groups) * decay + inflow  # (s, g, j, p, n)
    y = torch.einsum("sgjpn,sgn->sgjp", new, C.float()) + D.float().view(groups, -1, 1) * x
    return y.flatten(1, 2), new.flatten(1, 2)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L) with [l, s] = a[s+1] + ... + a[l] for s <= l, -inf above.

    Summed per column from the masked terms rather than as a difference of two
    cumulative sums, which loses precision once the sums grow large.
    """
    length = a.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, length)
    sums = terms.masked_fill(~ones.tril(-1), 0).cumsum(dim=-2)
    return sums.masked_fill(~ones.tril(), -torch.inf)


def chunk_length(lengths: Sequence[int], chunk_size: int) -> int:
    """The chunk length a prefill's scan cuts its sequences into: `chunk_size`, or the
    longest sequence's length rounded up to a power of two where that is shorter (a batch
    of short prompts pads less)."""
    longest = max(max(lengths, default=1), 1)
    return min(chunk_size, 1 << (longest - 1).bit_length())


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: list[int],
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of every sequence, chunked (Mamba2's state-space duality).

    x (T, H, P); dt (T, H) from `time_step`; A, D (H,); B, C (T, G, N);
    initial_state (S, H, P, N). Returns y (T, H, P) and the final states
    (S, H, P, N), both fp32.

    Every sequence is cut into its own chunks (none spans two sequences), the
    last one zero-padded: padding has dt = 0, so it neither decays nor feeds
    the state. Within a chunk the scan is a masked attention-like product;
    across chunks the states are passed on one chunk index at a time, all
    sequences together. The chunk length is an evaluation order, not part of
    the result, so short batches use shorter chunks and pad less.
    """
    num_tokens, num_heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    device = x.device
    lengths = [end - start for start, end in itertools.pairwise(cu_seqlens)]
    chunk = chunk_length(lengths, chunk_size)
    seq_chunks = [math.ceil(n / chunk) for n in lengths]
    num_chunks = sum(seq_chunks)
    first_chunk = [0, *itertools.accumulate(seq_chunks)]

    # Row of each token in the padded (chunk, position) layout.
    as_tensor = lambda values: torch.tensor(values, device=device)  # noqa: E731
    seq = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), as_tensor(lengths), output_size=num_tokens
    )
    local = torch.arange(num_tokens, device=device) - as_tensor(cu_seqlens[:-1])[seq]
    rows = (as_tensor(first_chunk[:-1])[seq] + local // chunk) * chunk + local % chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros(num_chunks * chunk, *t.shape[1:]).index_copy_(0, rows, t)
        return padded.view(num_chunks, chunk, *t.shape[1:])

    # Heads split as (group, head in group) so B and C are never copied per head.
    xdt = chunked(_split_heads(x * dt[..., None], groups))  # (c, l, g, j, p)
    B_c, C_c = chunked(B.float()), chunked(C.float())  # (c, l, g, n)
    a = chunked(_split_heads(dt * A, groups)).permute(0, 2, 3, 1)  # (c, g, j, l): log-decays
    a_cum = a.cumsum(dim=-1)

    # Within each chunk, from a zero state: outputs, and the state left at its end.
    shape = (groups, num_heads // groups)
    y = torch.empty(num_chunks, chunk, *shape, head_dim, device=device)
    states = torch.zeros(num_chunks + 1, *shape, head_dim, state_size, device=device)
    step = max(1, _INTRA_CHUNK_ELEMENTS // (num_heads * chunk * chunk))
    for lo in range(0, num_chunks, step):
        part = slice(lo, min(lo + step, num_chunks))
        scores = torch.einsum("clgn,csgn->cgls", C_c[part], B_c[part])[:, :, None]
        scores = scores * torch.exp(_segment_sum(a[part]))
        y[part] = torch.einsum("cgjls,csgjp->clgjp", scores, xdt[part])
        to_end = torch.exp(a_cum[part, ..., -1:] - a_cum[part])
        states[part] = torch.einsum("clgn,cgjl,clgjp->cgjpn", B_c[part], to_end, xdt[part])

    # Across chunks: chunk j of every sequence at once. Index `num_chunks` is a
    # no-op chunk (decay 1, no input) for sequences with fewer chunks.
    chunk_decay = torch.ones(num_chunks + 1, num_heads, device=device)
    chunk_decay[:num_chunks] = torch.exp(a_cum[..., -1]).flatten(1)
    states = states.flatten(1, 2)
    grid = [
        [
            first + j if j < n else num_chunks
            for first, n in zip(first_chunk, seq_chunks, strict=False)
        ]
        for j in range(max(seq_chunks))
    ]
    start_states = torch.empty_like(states)
    state = initial_state.float()
    for ids in as_tensor(grid).view(-1, len(lengths)):
        start_states[ids] = state
        state = chunk_decay[ids][..., None, None] * state + states[ids]

    # What each chunk's start state adds to its outputs.
    start_states = start_states[:num_chunks].unflatten(1, shape)
    from_start = torch.einsum("clgn,cgjpn->clgjp", C_c, start_states)
    y = y + torch.exp(a_cum).permute(0, 3, 1, 2)[..., None] * from_start
    y = y.view(num_chunks * chunk, num_heads, head_dim)[rows]
    return y + D.float()[:, None] * x.float(), state
