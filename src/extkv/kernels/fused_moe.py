"""A mixture-of-experts layer's routed experts on CUDA in four kernels, with no host sync.

The reference (extkv.models.reference.moe_experts) asks the host which experts were hit
and runs them one by one: shapes the host decides, which no CUDA graph can capture. Here:

1. the token-expert pairs are sorted by expert on the device into a padded layout of
   blocks of BLOCK_M rows, each block one expert's; its length is bounded by what any
   routing could need, so every shape follows from the number of tokens alone (a decode
   step's graph captures it);
2. a grouped GEMM over the blocks: each block's tokens times its expert's gate and up
   rows, SiLU(gate) * up fused in its epilogue, one row per pair;
3. a grouped GEMM of those rows with the experts' down projections;
4. per token, the sum of its top_k rows scaled by their routing weights (plus the shared
   experts' output, DeepSeek's), in fp32, rounded once.

Blocks past the used ones (the bound is loose) exit at once. Within one tiling (decode's
covers batches up to 16 pairs an expert on average) every row's result depends on its own
inputs only: a request's outputs do not depend on the batch it is in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from extkv.kernels.activation import silu_times
from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid

_SUM_BLOCK = 1024  # columns per program of the weighted sum
_SORT_CHUNK_CELLS = 8192  # pairs x experts of the sort's one-hot tile per step


@dataclass(frozen=True)
class ExpertTiles:
    """The grouped GEMMs' tiling: BLOCK_M pair rows (the padded layout's block), BLOCK_N
    output columns, BLOCK_K of the reduction per step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


# A decode step routes a few rows to each expert: blocks of 16 (tl.dot's least) waste the
# least, and the weight's read is the cost. Prefill's experts take many rows: larger blocks
# read each expert's weight fewer times.
DECODE_TILES = ExpertTiles(16, 64, 128)
PREFILL_TILES = ExpertTiles(64, 64, 64)


def expert_tiles(num_pairs: int, num_experts: int, itemsize: int) -> ExpertTiles:
    """The tiling for `num_pairs` token-expert pairs over `num_experts` experts, of
    `itemsize`-byte values (fp32 halves BLOCK_K, to keep the stages' shared memory)."""
    tiles = DECODE_TILES if num_pairs <= 16 * num_experts else PREFILL_TILES
    return replace(tiles, block_k=tiles.block_k * 2 // max(itemsize, 2))


# Up to this many token-expert pairs (every decode batch up to 256 sequences at top-8) one
# program sorts them, in one launch; a sort in torch ops takes about 25 small kernels, whose
# launches would cost a decode step's graph more than its expert GEMMs. Past it (prefill,
# eager) the torch ops sort in parallel where one program would loop for milliseconds.
ONE_PROGRAM_MAX_PAIRS = 2048


def num_sorted_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of `block_m` rows that hold any routing of `num_pairs` pairs: they fall to
    at most min(E, pairs) experts, each run padded by at most block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def sort_by_expert(
    indices: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (token t, slot j) of `indices` (T, top_k), numbered t * top_k + j, grouped
    by expert in blocks of `block_m`: (sorted_pairs, block_experts).

    sorted_pairs (num_blocks * block_m,) int32: each expert's pairs in ascending order,
    its run padded with T * top_k (no pair) to a multiple of block_m, the runs in expert
    order; block_experts (num_blocks,) int32: each block's expert, -1 past the used ones;
    num_blocks is `num_sorted_blocks`. On the device, with no host sync: one program up to
    ONE_PROGRAM_MAX_PAIRS pairs, torch ops past it (the same result)."""
    if indices.numel() <= ONE_PROGRAM_MAX_PAIRS:
        return _sort_in_one_program(indices, num_experts, block_m)
    return _sort_in_torch(indices, num_experts, block_m)


def _sort_in_torch(
    indices: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort_by_expert` as a stable sort and prefix sums."""
    flat = indices.flatten()
    num_pairs = flat.numel()
    device = flat.device
    expert_of, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first position in `order`
    rank = torch.arange(num_pairs, device=device) - first[expert_of]
    dest = (padded_ends - padded)[expert_of] + rank
    num_blocks = num_sorted_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts.to(torch.int32)


@triton.jit
def _sort_kernel(
    indices_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: a counting sort of the pairs by expert, CHUNK pairs at a time, each
    pair's expert as a one-hot row over EXPERTS_P2 columns (its rank among its expert's
    pairs is a prefix sum down its column)."""
    wait_for_previous_grid(USE_PDL)
    experts = tl.arange(0, EXPERTS_P2)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((EXPERTS_P2,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        expert = tl.load(indices_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    length = num_blocks * BLOCK_M
    for start in range(0, length, CHUNK):
        rows = start + lanes
        tl.store(sorted_pairs_ptr + rows, tl.zeros((CHUNK,), tl.int32) + num_pairs, rows < length)
    tl.debug_barrier()  # the padding is written before any pair overwrites its place
    next_row = ends - padded  # each expert's next free row
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        live = pairs < num_pairs
        expert = tl.load(indices_ptr + pairs, mask=live, other=-1).to(tl.int32)
        one_hot = (expert[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # this chunk's pairs before, same expert
        row = tl.sum(one_hot * (next_row[None, :] + earlier), axis=1)
        tl.store(sorted_pairs_ptr + row, pairs, mask=live)
        next_row += tl.sum(one_hot, axis=0)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + lanes
        # A block's expert: how many experts' padded runs end at or before its first row.
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < num_blocks)


def _sort_in_one_program(
    indices: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort_by_expert` in `_sort_kernel`."""
    num_pairs = indices.numel()
    num_blocks = num_sorted_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=indices.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=indices.device)
    experts_p2 = triton.next_power_of_2(num_experts)
    _sort_kernel[(1,)](
        indices,
        sorted_pairs,
        block_experts,
        num_pairs,
        num_experts,
        num_blocks,
        BLOCK_M=block_m,
        EXPERTS_P2=experts_p2,
        CHUNK=min(256, max(16, _SORT_CHUNK_CELLS // experts_p2)),
        num_warps=8,
        **pdl_launch(indices.device),
    )
    return sorted_pairs, block_experts


@triton.jit
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    GATED: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (i, j): block i of the sorted pairs (one expert's rows) times columns tile j
    of that expert's weight (E, rows, K), into row `pair` of out (pairs, N).

    GATHER: a's rows are tokens (pair // top_k), else pairs. GATED: the weight's rows are
    gate [0, N) then up [N, 2N), and out takes silu(gate) * up, each rounded to out's dtype
    first as the reference's linear and activation round."""
    wait_for_previous_grid(USE_PDL)
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < num_pairs
    rows = pairs
    if GATHER:
        rows = pairs // top_k
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)
    a_row = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_col = w_ptr + expert.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        kk = start + k
        k_ok = kk < K
        a = tl.load(a_row + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_col + kk[:, None], mask=w_ok, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(w_col + N * stride_wn + kk[:, None], mask=w_ok, other=0.0)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    result = acc.to(dtype)
    if GATED:
        result = silu_times(result.to(tl.float32), acc_up.to(dtype).to(tl.float32), out_ptr)
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, result, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _weighted_sum_kernel(
    rows_ptr,
    weights_ptr,
    shared_ptr,
    out_ptr,
    H,
    stride_rm,
    stride_wt,
    stride_st,
    stride_ot,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, j): columns block j of token t's output, the sum of its TOP_K rows (pairs
    t * TOP_K + slot) times their weights, plus its shared row, in fp32."""
    wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        weight = tl.load(weights_ptr + token * stride_wt + slot).to(tl.float32)
        row = rows_ptr + (token * TOP_K + slot) * stride_rm + cols
        acc += weight * tl.load(row, mask=live, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + token * stride_st + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


def _check_operands(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    shared: torch.Tensor | None,
) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be (T, H) with contiguous rows, got {tuple(x.shape)}")
    tokens, hidden = x.shape
    if gate_up.dim() != 3 or gate_up.shape[1] % 2 or gate_up.shape[2] != hidden:
        raise ValueError(f"gate_up must be (E, 2I, H={hidden}), got {tuple(gate_up.shape)}")
    experts, inner = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (experts, hidden, inner):
        raise ValueError(
            f"down must be (E, H, I) = {(experts, hidden, inner)}, got {tuple(down.shape)}"
        )
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("gate_up and down need contiguous rows (stride(2) == 1)")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(
            f"gate_up ({gate_up.dtype}) and down ({down.dtype}) must have x's dtype {x.dtype}"
        )
    if indices.dim() != 2 or indices.shape[0] != tokens or weights.shape != indices.shape:
        raise ValueError(
            f"indices and weights must both be (T={tokens}, top_k), got "
            f"{tuple(indices.shape)} and {tuple(weights.shape)}"
        )
    if not indices.is_contiguous() or weights.stride(1) != 1:
        raise ValueError("indices must be contiguous and weights need contiguous rows")
    if shared is not None and (shared.shape != x.shape or shared.stride(1) != 1):
        raise ValueError(f"shared must be x's shape {tuple(x.shape)}, got {tuple(shared.shape)}")


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    shared: torch.Tensor | None = None,
    tiles: ExpertTiles | None = None,
) -> torch.Tensor:
    """`reference.moe_experts` in four kernels: x (T, H), gate_up (E, 2I, H), down
    (E, H, I), weights and indices (T, top_k), shared (T, H) or None -> (T, H) in x's
    dtype. Allocates only by the number of tokens, so a CUDA graph captures it. `tiles`
    overrides the tiling (the tests force several)."""
    _check_operands(x, gate_up, down, weights, indices, shared)
    tokens, hidden = x.shape
    experts, inner = gate_up.shape[0], gate_up.shape[1] // 2
    top_k = indices.shape[1]
    out = torch.empty_like(x)
    if not tokens:
        return out
    num_pairs = tokens * top_k
    tiles = tiles or expert_tiles(num_pairs, experts, x.element_size())
    sorted_pairs, block_experts = sort_by_expert(indices, experts, tiles.block_m)
    num_blocks = block_experts.numel()
    launch = pdl_launch(x.device)
    gemm = dict(
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **launch,
    )

    def expert_gemm(a: torch.Tensor, w: torch.Tensor, n: int, k: int, first: bool) -> torch.Tensor:
        """Every pair's row of `a` times its expert's `w` -> (pairs, n): the first GEMM
        gathers x's rows by token and gates (silu(gate) * up), the second reads pair rows."""
        product = a.new_empty(num_pairs, n)
        _expert_gemm_kernel[(num_blocks, triton.cdiv(n, tiles.block_n))](
            a,
            w,
            product,
            sorted_pairs,
            block_experts,
            num_pairs,
            n,
            k,
            top_k,
            a.stride(0),
            w.stride(0),
            w.stride(1),
            product.stride(0),
            GATED=first,
            GATHER=first,
            **gemm,
        )
        return product

    activated = expert_gemm(x, gate_up, inner, hidden, first=True)
    rows = expert_gemm(activated, down, hidden, inner, first=False)
    _weighted_sum_kernel[(tokens, triton.cdiv(hidden, _SUM_BLOCK))](
        rows,
        weights,
        rows if shared is None else shared,  # never read without HAS_SHARED
        out,
        hidden,
        rows.stride(0),
        weights.stride(0),
        0 if shared is None else shared.stride(0),
        out.stride(0),
        TOP_K=top_k,
        HAS_SHARED=shared is not None,
        BLOCK=_SUM_BLOCK,
        num_warps=4,
        **launch,
    )
    return out
