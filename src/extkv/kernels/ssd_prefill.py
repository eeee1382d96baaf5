"""Mamba2's chunked SSD scan for a prefill step on the GPU, in three kernels.

`extkv.models.mamba2_ops.ssd_varlen` (the oracle) evaluates the scan in torch:
per chunk a (chunk x chunk) decay matrix per head, materialised, then einsums.
At 64 prompts of 256 tokens that is hundreds of MiB per intermediate per layer
and most of a hybrid model's prefill time. Here each chunk's decays are built in
registers, tile by tile, as a causal attention kernel builds its scores:

1. `_chunk_state_kernel`, one program per (chunk, head, channel tile): the state a
   chunk leaves from a zero start, sum over l of exp(a_end - a_cum[l]) dt[l] x[l] B[l]^T,
   accumulated over key tiles with the decay applied online (every exponent <= 0), and
   the in-chunk cumulative log-decays a_cum for step 3.
2. `_state_passing_kernel`, one program per (sequence, head, channel tile): walks the
   sequence's chunks in order, start[c] = running, running = decay[c] running + state[c];
   the last `running` is the sequence's final state.
3. `_chunk_scan_kernel`, one program per (chunk, head, row tile): y[l] = exp(a_cum[l])
   C[l] start[c] + sum over s <= l of (C[l] . B[s]) exp(a_cum[l] - a_cum[s]) dt[s] x[s],
   plus D x[l], written straight to the token's row.

Chunks are cut per sequence (none spans two), as in the oracle; a chunk is a run of
token rows, so nothing is padded or copied into a chunk layout. Products of the bf16
(or fp16) inputs C . B run on tensor cores exactly (fp32 accumulation); products with
fp32 operands (decayed scores, states) use tf32x3, close to fp32 (ieee for fp32 models).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from extkv.models.mamba2_ops import chunk_length

_BLOCK_L = 64  # token rows per tile (rows of the scan, keys of the chunk state)
_BLOCK_P_MAX = 64  # head channels per program


@triton.jit
def _chunk_state_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    a_cum_ptr,
    state_ptr,
    decay_ptr,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_dtt,
    stride_dth,
    stride_bt,
    stride_bg,
    stride_bn,
    num_heads,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    group = head // HEADS_PER_GROUP
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    A = tl.load(a_ptr + head).to(tl.float32)
    row = chunk * num_heads + head
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    running = tl.sum(tl.zeros([BLOCK_L], tl.float32), axis=0)  # a_cum at the tiles' end
    for lo in range(0, CHUNK, BLOCK_L):
        rows = lo + tl.arange(0, BLOCK_L)
        live = rows < length
        t = start + rows
        dt = tl.load(dt_ptr + t * stride_dtt + head * stride_dth, mask=live, other=0.0)
        a_cum = running + tl.cumsum(dt * A, axis=0)
        tl.store(a_cum_ptr + row * CHUNK + rows, a_cum, mask=rows < CHUNK)
        end = running + tl.sum(dt * A, axis=0)
        x = tl.load(
            x_ptr + t[:, None] * stride_xt + head * stride_xh + p[None, :] * stride_xp,
            mask=live[:, None] & (p[None, :] < HEAD_DIM),
            other=0.0,
        ).to(tl.float32)
        B = tl.load(
            b_ptr + t[:, None] * stride_bt + group * stride_bg + n[None, :] * stride_bn,
            mask=live[:, None] & (n[None, :] < STATE_SIZE),
            other=0.0,
        ).to(tl.float32)
        weight = dt * tl.exp(end - a_cum)  # 0 past the chunk's end (dt = 0 there)
        acc = acc * tl.exp(end - running)
        acc = tl.dot(tl.trans(x * weight[:, None]), B, acc, input_precision=DOT_PRECISION)
        running = end
    cell = row * HEAD_DIM * STATE_SIZE + p[:, None] * STATE_SIZE + n[None, :]
    tl.store(state_ptr + cell, acc, mask=(p[:, None] < HEAD_DIM) & (n[None, :] < STATE_SIZE))
    if tl.program_id(2) == 0:
        tl.store(decay_ptr + row, tl.exp(running))


@triton.jit
def _state_passing_kernel(
    state_ptr,
    decay_ptr,
    cache_ptr,
    index_ptr,
    carry_ptr,
    seq_first_chunk_ptr,
    stride_cb,
    stride_ch,
    stride_cp,
    stride_cn,
    num_heads,
    HEAD_DIM: tl.constexpr,
    STATE_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CACHE: tl.constexpr,
):
    """Start states in place of the chunk states; the final state to the cache row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    tile = (p[:, None] < HEAD_DIM) & (n[None, :] < STATE_SIZE)
    cell = p[:, None] * STATE_SIZE + n[None, :]
    per_row = HEAD_DIM * STATE_SIZE
    running = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    if HAS_CACHE:
        block = tl.load(index_ptr + seq).to(tl.int64)
        carry = (tl.load(carry_ptr + seq) != 0) & (block >= 0)
        cached = cache_ptr + block * stride_cb + head * stride_ch
        cached += p[:, None] * stride_cp + n[None, :] * stride_cn
        running = tl.load(cached, mask=tile & carry, other=0.0).to(tl.float32)
    first = tl.load(seq_first_chunk_ptr + seq)
    last = tl.load(seq_first_chunk_ptr + seq + 1)
    for chunk in range(first, last):
        row = (chunk * num_heads + head).to(tl.int64)
        state = tl.load(state_ptr + row * per_row + cell, mask=tile)
        tl.store(state_ptr + row * per_row + cell, running, mask=tile)  # now its start state
        running = tl.load(decay_ptr + row) * running + state
    if HAS_CACHE:
        tl.store(cached, running.to(cache_ptr.dtype.element_ty), mask=tile & (block >= 0))


@triton.jit
def _chunk_scan_kernel(
    out_ptr,
    x_ptr,
    dt_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    a_cum_ptr,
    start_state_ptr,
    stride_ot,
    stride_oh,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_dtt,
    stride_dth,
    stride_bt,
    stride_bg,
    stride_bn,
    stride_ct,
    stride_cg,
    stride_cn,
    num_heads,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    P_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXACT_PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    lo = tl.program_id(2) // P_TILES * BLOCK_L
    length = tl.load(chunk_len_ptr + chunk)
    if lo >= length:
        return
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    group = head // HEADS_PER_GROUP
    row = chunk * num_heads + head
    p = tl.program_id(2) % P_TILES * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_live = p < HEAD_DIM
    n_live = n < STATE_SIZE
    rows = lo + tl.arange(0, BLOCK_L)
    l_live = rows < length
    t = start + rows
    a_l = tl.load(a_cum_ptr + row * CHUNK + rows, mask=l_live, other=0.0)
    C = tl.load(
        c_ptr + t[:, None] * stride_ct + group * stride_cg + n[None, :] * stride_cn,
        mask=l_live[:, None] & n_live[None, :],
        other=0.0,
    )
    # What the chunk's start state adds: exp(a_cum[l]) C[l] start^T.
    start_state = tl.load(
        start_state_ptr + row * HEAD_DIM * STATE_SIZE + p[None, :] * STATE_SIZE + n[:, None],
        mask=p_live[None, :] & n_live[:, None],
        other=0.0,
    )  # (N, P)
    acc = tl.dot(C.to(tl.float32), start_state, input_precision=DOT_PRECISION)
    acc = acc * tl.exp(a_l)[:, None]
    for s_lo in range(0, lo + BLOCK_L, BLOCK_L):
        s = s_lo + tl.arange(0, BLOCK_L)
        s_live = s < length
        ts = start + s
        B = tl.load(
            b_ptr + ts[:, None] * stride_bt + group * stride_bg + n[None, :] * stride_bn,
            mask=s_live[:, None] & n_live[None, :],
            other=0.0,
        )
        scores = tl.dot(C, tl.trans(B), input_precision=EXACT_PRECISION)
        a_s = tl.load(a_cum_ptr + row * CHUNK + s, mask=s_live, other=0.0)
        dt = tl.load(dt_ptr + ts * stride_dtt + head * stride_dth, mask=s_live, other=0.0)
        causal = (s[None, :] <= rows[:, None]) & s_live[None, :]
        decay = tl.exp(tl.where(causal, a_l[:, None] - a_s[None, :], float("-inf")))
        x = tl.load(
            x_ptr + ts[:, None] * stride_xt + head * stride_xh + p[None, :] * stride_xp,
            mask=s_live[:, None] & p_live[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = tl.dot(scores * decay * dt[None, :], x, acc, input_precision=DOT_PRECISION)
    x_l = tl.load(
        x_ptr + t[:, None] * stride_xt + head * stride_xh + p[None, :] * stride_xp,
        mask=l_live[:, None] & p_live[None, :],
        other=0.0,
    ).to(tl.float32)
    acc += tl.load(d_ptr + head).to(tl.float32) * x_l
    tl.store(
        out_ptr + t[:, None] * stride_ot + head * stride_oh + p[None, :],
        acc,
        mask=l_live[:, None] & p_live[None, :],
    )


@dataclass(frozen=True)
class ChunkLayout:
    """Each sequence of a step cut into chunks of at most `chunk` tokens (none spans two
    sequences), int32 on the device: each chunk's first token row, length, sequence, and
    offset in its sequence; each sequence's first chunk (num_seqs + 1 entries)."""

    starts: torch.Tensor
    lengths: torch.Tensor
    seqs: torch.Tensor
    offsets: torch.Tensor
    seq_first_chunk: torch.Tensor
    chunk: int

    @property
    def num_chunks(self) -> int:
        return self.starts.numel()

    @property
    def num_seqs(self) -> int:
        return self.seq_first_chunk.numel() - 1


def chunk_layout(cu_seqlens: Sequence[int], chunk_size: int, device: torch.device) -> ChunkLayout:
    """The layout of a step's sequences (`cu_seqlens` on the host) in chunks as
    `ssd_varlen` cuts them (`chunk_length`), built in one copy."""
    lengths = [end - start for start, end in itertools.pairwise(cu_seqlens)]
    chunk = chunk_length(lengths, chunk_size)
    chunks = [
        (seq_start + lo, min(chunk, n - lo), seq, lo)
        for seq, (seq_start, n) in enumerate(zip(cu_seqlens, lengths, strict=False))
        for lo in range(0, n, chunk)
    ]
    first = itertools.accumulate((-(-n // chunk) for n in lengths), initial=0)
    columns = [value for column in zip(*chunks, strict=True) for value in column]
    packed = torch.tensor([*columns, *first], dtype=torch.int32).to(device)
    num_chunks = len(chunks)
    parts = packed[: 4 * num_chunks].view(4, num_chunks)
    return ChunkLayout(*parts, packed[4 * num_chunks :], chunk)


def ssd_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    layout: ChunkLayout,
    ssm_state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ssd_varlen` in Triton kernels, reading and writing the states in the cache: y
    (T, H, P) fp32. x (T, H, P) and B, C (T, G, N) may be strided views (of the conv
    output); dt (T, H) fp32 from `time_step`. Sequence s starts from row
    `state_indices[s]` of ssm_state (num_blocks, H, P, N) where `has_initial_state[s]`
    (zeros otherwise) and leaves its final state there (-1: a padding row, zeros, not
    written); without `ssm_state` every sequence starts from zeros and nothing is kept."""
    num_tokens, num_heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    device = x.device
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
    num_chunks, chunk = layout.num_chunks, layout.chunk
    block_l = min(_BLOCK_L, max(chunk, 16))
    block_p = min(max(triton.next_power_of_2(head_dim), 16), _BLOCK_P_MAX)
    block_n = max(triton.next_power_of_2(state_size), 16)
    p_tiles = math.ceil(head_dim / block_p)
    a_cum = torch.empty(num_chunks, num_heads, chunk, dtype=torch.float32, device=device)
    states = torch.empty(
        num_chunks, num_heads, head_dim, state_size, dtype=torch.float32, device=device
    )
    decay = torch.empty(num_chunks, num_heads, dtype=torch.float32, device=device)
    dt = dt.float()
    shape = dict(HEAD_DIM=head_dim, STATE_SIZE=state_size, BLOCK_P=block_p, BLOCK_N=block_n)
    scan = dict(
        HEADS_PER_GROUP=num_heads // groups,
        CHUNK=chunk,
        BLOCK_L=block_l,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32x3",
        **shape,
    )
    if num_chunks:
        _chunk_state_kernel[(num_chunks, num_heads, p_tiles)](
            x, dt, A, B, layout.starts, layout.lengths, a_cum, states, decay,
            *x.stride(), *dt.stride(), *B.stride(), num_heads, **scan,
        )  # fmt: skip
    has_cache = ssm_state is not None
    cache = (ssm_state, state_indices, has_initial_state) if has_cache else (states, decay, decay)
    _state_passing_kernel[(layout.num_seqs, num_heads, p_tiles)](
        states, decay, *cache, layout.seq_first_chunk,
        *(ssm_state.stride() if has_cache else (0,) * 4), num_heads, HAS_CACHE=has_cache,
        **shape,
    )  # fmt: skip
    if num_chunks:
        _chunk_scan_kernel[(num_chunks, num_heads, triton.cdiv(chunk, block_l) * p_tiles)](
            y, x, dt, B, C, D, layout.starts, layout.lengths, a_cum, states,
            *y.stride()[:2], *x.stride(), *dt.stride(), *B.stride(), *C.stride(), num_heads,
            P_TILES=p_tiles, EXACT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            **scan,
        )  # fmt: skip
    return y
