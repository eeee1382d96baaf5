"""Causal flash attention over a prefill's own K/V: prompts with nothing cached.

Where no sequence of a prefill continues a cached prefix, every key a query sees is one
of the step's new tokens, so attention can read the step's contiguous K/V rows rather
than gather them through the block table (the paged kernel's way, one 16-token block at
a time). The step's K/V still go to the paged cache as always; only the reads move.

A program owns one query head and one tile of BLOCK_M tokens of one sequence and walks
the key tiles its rows see: the ones every row sees in full without a mask, the tiles
across the diagonal (and a sliding window's far edge) under it. Query heads index
their KV head (GQA); the programs of one tile's heads run side by side, so each K/V
tile is read from memory once and from L2 by the group's other heads. The tiles
furthest down the causal triangle (the most keys) are launched first. On sm90 the Q,
K and V tiles come through TMA tensor descriptors; elsewhere (and where a row's layout
does not allow TMA) through masked pointer loads.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from extkv.attention.metadata import AttentionMetadata
from extkv.kernels.paged_attention import NO_WINDOW, Tiles, _shared_memory
from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid
from extkv.kernels.rotary import qk_norm_rope_store

_LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 256  # wider rows (MLA's latent) stay on the paged kernel


@triton.jit
def _load_rows(
    src,
    seq_start,
    first,
    limit,
    head,
    stride_t,
    stride_h,
    dim,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Rows `first`..`first + ROWS` of a sequence's tokens (from token `seq_start` of the
    step), one head. TMA reads past the sequence (the next one's rows, zeros past the
    step), which only rows and keys the causal mask hides meet; MASKED pointer loads
    give zeros from `limit` on."""
    if USE_TMA:
        tile = src.load([seq_start + first, head * HEAD_DIM])
    else:
        rows = first + tl.arange(0, ROWS)
        offs = (seq_start + rows).to(tl.int64)[:, None] * stride_t + head * stride_h
        ptrs = src + offs + dim[None, :]
        if MASKED:
            mask = (rows < limit)[:, None] & (dim < HEAD_DIM)[None, :]
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif HEAD_DIM == HEAD_DIM_P2:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(dim < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _attend_tile(
    q,
    q_pos,
    start,
    row_max,
    row_sum,
    acc,
    k_src,
    v_src,
    seq_start,
    seq_len,
    kv_head,
    qk_scale,
    window,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    dim,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the BLOCK_N keys from `start`, the scale folded into
    the base-2 exponent. MASKED: the causal (and window) mask; a tile every row sees whole
    goes without, one multiply-add per score."""
    k = _load_rows(
        k_src, seq_start, start, seq_len, kv_head, stride_kt, stride_kh, dim,
        BLOCK_N, HEAD_DIM, HEAD_DIM_P2, MASKED, USE_TMA,
    )  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        kv_pos = start + tl.arange(0, BLOCK_N)
        visible = kv_pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            visible &= kv_pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s * qk_scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        max_ref = new_max
        if HAS_WINDOW:  # a row whose window starts past this tile has seen no key yet
            max_ref = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(s - max_ref[:, None])
    else:
        new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
        max_ref = new_max
        p = tl.exp2(s * qk_scale - new_max[:, None])
    alpha = tl.exp2(row_max - max_ref)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    v = _load_rows(
        v_src, seq_start, start, seq_len, kv_head, stride_vt, stride_vh, dim,
        BLOCK_N, HEAD_DIM, HEAD_DIM_P2, MASKED, USE_TMA,
    )  # fmt: skip
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return new_max, row_sum, acc


@triton.jit
def _prefill_attention_kernel(
    out_ptr,
    q_src,
    k_src,
    v_src,
    cu_seqlens_ptr,
    qk_scale,
    window,
    num_q_tiles,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (num_q_heads, num_seqs, num_q_tiles), the last query tile first; online
    softmax in fp32. Key tiles in three runs: those a sliding window's edge cuts (masked,
    HAS_WINDOW only), those every row of the tile sees (no mask), those across the
    diagonal (masked). Without a window every row meets key 0 in its first tile, so no
    row's running max stays -inf."""
    wait_for_previous_grid(USE_PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    first = (num_q_tiles - 1 - tl.program_id(2)) * BLOCK_M  # the tile's first token
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    if first >= seq_len:
        return
    kv_head = head // GROUP
    dim = tl.arange(0, HEAD_DIM_P2)
    q = _load_rows(
        q_src, seq_start, first, seq_len, head, stride_qt, stride_qh, dim,
        BLOCK_M, HEAD_DIM, HEAD_DIM_P2, True, USE_TMA,
    )  # fmt: skip
    q_pos = first + tl.arange(0, BLOCK_M)

    # Keys [lo, hi) are seen by some row; [full_lo, full_hi) by every row, whole.
    hi = tl.minimum(first + BLOCK_M, seq_len)
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        last_sees = tl.maximum(first + BLOCK_M - window, 0)  # the tile's last row's first key
        full_lo = tl.minimum(tl.maximum(tl.cdiv(last_sees, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.minimum(tl.maximum((first + 1) // BLOCK_N * BLOCK_N, full_lo), hi)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    for run in tl.static_range(0 if HAS_WINDOW else 1, 3):
        run_lo = lo if run == 0 else (full_lo if run == 1 else full_hi)
        run_hi = full_lo if run == 0 else (full_hi if run == 1 else hi)
        for start in range(run_lo, run_hi, BLOCK_N):
            row_max, row_sum, acc = _attend_tile(
                q, q_pos, start, row_max, row_sum, acc, k_src, v_src, seq_start, seq_len,
                kv_head, qk_scale, window, stride_kt, stride_kh, stride_vt, stride_vh, dim,
                BLOCK_N, HEAD_DIM, HEAD_DIM_P2, run != 1, HAS_WINDOW, USE_TMA, DOT_PRECISION,
            )  # fmt: skip

    # Every row of the sequence has seen its own key; one past its end may have seen none.
    o = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    offs = (seq_start + q_pos).to(tl.int64)[:, None] * stride_ot + head * stride_oh
    io_mask = (q_pos < seq_len)[:, None] & (dim < HEAD_DIM)[None, :]
    tl.store(out_ptr + offs + dim[None, :], o.to(out_ptr.dtype.element_ty), mask=io_mask)


# Chosen for Hopper by reasoning, to be swept on the device (benchmarks/bench_attention.py
# --prefill --sweep): 128 x 128 score tiles on two warpgroups; compiled for sm90 with
# Triton 3.6 they take 242 registers a thread, none spilled, and 161 KiB of shared memory.
PREFILL_TILES = Tiles(block_m=128, block_n=128, num_warps=8, num_stages=2)


def fit_tiles(tiles: Tiles, head_dim_p2: int, itemsize: int, device: torch.device) -> Tiles:
    """`tiles` cut until a program's shared memory fits the device: the Q tile and
    `num_stages` K and V tiles each (what Triton 3.6 allocates for sm90, plus 1 KiB of
    barriers). Fewer stages (down to 2) first, then fewer keys, then fewer queries a
    tile: head dim 256 in bf16 gets 64-key tiles."""
    limit = _shared_memory(device) - 2048
    block_m, block_n, stages = tiles.block_m, tiles.block_n, tiles.num_stages
    while (block_m + 2 * stages * block_n) * head_dim_p2 * itemsize > limit:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > 16:
            block_m //= 2
        else:
            raise ValueError(
                f"prefill attention tiles of head dim {head_dim_p2} do not fit in "
                f"{limit + 2048} bytes of shared memory"
            )
    return Tiles(block_m, block_n, tiles.num_warps, stages)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes rows of this width and dtype (else: the paged kernel)."""
    return head_dim <= MAX_HEAD_DIM and dtype in (torch.bfloat16, torch.float16, torch.float32)


def _tma_ready(t: torch.Tensor, head_dim: int) -> bool:
    """Whether (T, H, D) rows can be read as TMA tiles of a (T, H * D) matrix: heads
    side by side, a 16-byte-aligned start and row stride, D a power of two from 16 (a
    wider tile would read the next head's channels)."""
    return (
        head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and t.stride(2) == 1
        and t.stride(1) == head_dim
        and t.stride(0) * t.element_size() % 16 == 0
        and t.data_ptr() % 16 == 0
    )


@functools.cache
def _tma_supported(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        import triton.tools.tensor_descriptor  # noqa: F401  (Triton >= 3.3)
    except ImportError:
        return False
    return True


def _descriptor(t: torch.Tensor, rows: int, head_dim: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, num_heads, _ = t.shape
    return TensorDescriptor(
        t, [num_tokens, num_heads * head_dim], [t.stride(0), 1], [rows, head_dim]
    )


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    use_tma: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its own key/value rows:
    query (T, Hq, D), key and value (T, Hkv, D), any row and head strides with contiguous
    channels (value may be a view of the fused qkv projection); `cu_seqlens` (num_seqs + 1,)
    int32 on the device, `max_seqlen` its longest sequence (known on the host: no sync).
    With `sliding_window` W a query sees its last W positions only.

    `out` (T, Hq, D) is written if given; `tiles` and `use_tma` (None: on sm90 where the
    rows allow) override the launch (benchmarks/bench_attention.py sweeps them)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of key/value heads ({num_kv_heads})"
        )
    if not supports(head_dim, query.dtype):
        raise ValueError(
            f"prefill_attention takes head_dim <= {MAX_HEAD_DIM} in bf16, fp16 or fp32; "
            f"got {head_dim}, {query.dtype}"
        )
    if any(t.stride(2) != 1 for t in (query, key, value)):
        raise ValueError("query, key and value must have contiguous channels (stride 1)")
    out = torch.empty_like(query, memory_format=torch.contiguous_format) if out is None else out
    if out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(
            f"out must be {tuple(query.shape)} like query, with contiguous channels; got "
            f"shape {tuple(out.shape)}, strides {out.stride()}"
        )
    if num_tokens == 0:
        return out
    head_dim_p2 = max(triton.next_power_of_2(head_dim), 16)  # tl.dot needs K >= 16
    tiles = fit_tiles(tiles or PREFILL_TILES, head_dim_p2, query.element_size(), query.device)
    if use_tma is None:
        use_tma = _tma_supported(query.device) and all(
            _tma_ready(t, head_dim) for t in (query, key, value)
        )
    sources = (query, key, value)
    if use_tma:
        sources = (
            _descriptor(query, tiles.block_m, head_dim),
            _descriptor(key, tiles.block_n, head_dim),
            _descriptor(value, tiles.block_n, head_dim),
        )
    num_q_tiles = triton.cdiv(max_seqlen, tiles.block_m)
    grid = (num_q_heads, cu_seqlens.numel() - 1, num_q_tiles)
    _prefill_attention_kernel[grid](
        out,
        *sources,
        cu_seqlens,
        scale * _LOG2E,
        sliding_window or NO_WINDOW,
        num_q_tiles,
        *query.stride()[:2],
        *key.stride()[:2],
        *value.stride()[:2],
        *out.stride()[:2],
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        HAS_WINDOW=sliding_window is not None,
        USE_TMA=use_tma,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **pdl_launch(query.device),
    )
    return out


def rope_store_prefill_attention(
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
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """A prefill step with nothing cached, as the engine runs it: one kernel norms and
    rotates q and k, writes k and v to the paged cache at the step's slots and hands k
    over in a tensor of its own; then `prefill_attention` over those rows, v read in place
    from qkv (T, (Hq + 2 Hkv) * D). Returns (T, Hq, D)."""
    head_dim = k_cache.shape[-1]
    keys = qkv.new_empty(qkv.shape[0], num_kv_heads, head_dim)
    prepare = (qkv, positions, cos_sin_cache, num_q_heads, num_kv_heads)
    norm = (q_norm_weight, k_norm_weight, eps)
    q = qk_norm_rope_store(*prepare, *norm, k_cache, v_cache, metadata.slot_mapping, keys)
    values = qkv.unflatten(1, (-1, head_dim))[:, num_q_heads + num_kv_heads :]
    return prefill_attention(
        q, keys, values, metadata.cu_seqlens_q, metadata.max_seqlen_q, scale, sliding_window
    )
