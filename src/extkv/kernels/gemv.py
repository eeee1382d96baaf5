"""y = x @ W^T (+ bias) for the few rows of a decode step, streaming W once.

cuBLAS's kernels for 1-16 rows read the weight at a fraction of the memory
bandwidth (and split K over a second reduce kernel). Here each program owns
BLOCK_N output features for every row of x, so W is read exactly once, and
walks K in pipelined chunks. The product is taken on the tensor cores with the
operands swapped, (BLOCK_N, K) @ (K, 16): x is always padded to 16 rows, so the
layouts and the order of every row's sum are the same whatever the number of
rows (a request's outputs do not depend on the batch it is in), and the
arithmetic never limits a memory-bound loop. Weights too narrow to give every
SM work (N=1024 at batch 1) split K over several programs per tile; the last
to finish adds the partial sums in a fixed order, so results are bit-identical
for the same inputs whichever program that is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # x's rows are padded to this: tl.dot's smallest dimension
_BLOCK_N = 64  # output features per program
_STAGE_BYTES = 16384  # bytes of W per pipeline stage: BLOCK_N * BLOCK_K * itemsize
_NUM_STAGES = 6
_MAX_SPLIT = 8  # slices of K per tile at most
_MIN_SLICE_STAGES = 3  # and each slice at least this many stages long
_INTERPRETED_SMS = 132  # the H200's, for block choices under the Triton interpreter (CPU)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    arrivals_ptr,
    num_rows,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (i, j): acc (BLOCK_N, BLOCK_M) = W_tile @ x^T in fp32 over the j-th of
    SPLIT_K slices of K. With SPLIT_K > 1 each program leaves its partial sum in
    `partial_ptr`, and the last of a tile's programs to arrive adds them up, always in
    slice order (so the result does not depend on which one that is)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < num_rows
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_col = x_ptr + m.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for start in range(k_begin, k_end, BLOCK_K):
        kk = start + k
        k_ok = kk < k_end
        w = tl.load(w_row + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_col + kk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    if SPLIT_K == 1:
        _store_output(acc, bias_ptr, y_ptr, n, m, n_ok, m_ok, stride_ym, HAS_BIAS)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + m[None, :]
        partials = partial_ptr + pid_n * (SPLIT_K * BLOCK_N * BLOCK_M) + tile
        tl.store(partials + pid_k * (BLOCK_N * BLOCK_M), acc, cache_modifier=".wt")
        tl.debug_barrier()  # every thread's partial is written before the arrival counts
        if tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for j in range(SPLIT_K):
                acc += tl.load(partials + j * (BLOCK_N * BLOCK_M), cache_modifier=".cv")
            _store_output(acc, bias_ptr, y_ptr, n, m, n_ok, m_ok, stride_ym, HAS_BIAS)
            tl.atomic_xchg(arrivals_ptr + pid_n, 0)  # ready for the next call


@triton.jit
def _store_output(acc, bias_ptr, y_ptr, n, m, n_ok, m_ok, stride_ym, HAS_BIAS: tl.constexpr):
    """y[m, n] = acc (BLOCK_N, BLOCK_M) + bias[n], in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class GemvConfig:
    """How the GEMV tiles one weight: output features per program, K per pipeline stage,
    slices of K (programs per tile), warps and pipeline stages per program."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def gemv_config(n: int, k: int, itemsize: int, num_sms: int) -> GemvConfig:
    """The tiling of a weight of n x k elements of `itemsize` bytes. It depends on the
    weight alone, never on the number of rows, so results are batch-invariant.

    Chosen by `benchmarks/bench_gemv.py --sweep` on the H200 (BENCHMARKS.md): tiles of
    64 output features, 16 KiB of W per pipeline stage (128 bf16 columns), 6 stages in
    flight; deep pipelines beat more, smaller programs. A narrow weight (under a
    quarter as many tiles as SMs: Qwen3-0.6B's N=1024) splits K, up to 8 ways, into
    slices of at least 3 stages, as long as no SM gets a second program.
    """
    block_k = min(_STAGE_BYTES // (itemsize * _BLOCK_N), max(triton.next_power_of_2(k), 16))
    tiles = triton.cdiv(n, _BLOCK_N)
    split_k = 1
    if 4 * tiles <= num_sms:
        while (
            split_k < _MAX_SPLIT
            and k >= 2 * split_k * _MIN_SLICE_STAGES * block_k
            and 2 * split_k * tiles <= num_sms
        ):
            split_k *= 2
    return GemvConfig(_BLOCK_N, block_k, split_k, num_stages=_NUM_STAGES)


def _arrivals(device: torch.device, count: int) -> torch.Tensor:
    """The split-K arrival counters of `device` (zero between calls: the last program of
    a tile resets its own). Made on first use, which must not be inside a graph capture:
    a warm-up call comes first, as for every Triton kernel (it compiles there)."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run linear_small_batch once before capturing it in a graph")
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _ARRIVALS[device] = counters
    return counters


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def linear_small_batch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias (N,) for M <= MAX_ROWS, accumulated in fp32,
    in x's dtype: nn.Linear's forward for a decode step's few rows. Allocates only
    the output (and split-K's partial sums), so it can be captured in a CUDA graph.
    `config` overrides the tiling (benchmarks/bench_gemv.py sweeps it)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_small_batch needs x (M, K) and weight (N, K), got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"linear_small_batch takes at most {MAX_ROWS} rows, got {num_rows}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            "linear_small_batch needs x and weight with contiguous rows (stride(1) == 1)"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight's dtype {weight.dtype} must be x's ({x.dtype})")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous ({n},), got {tuple(bias.shape)}")
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows and n:
        config = config or gemv_config(n, k, x.element_size(), _num_sms(x.device))
        tiles = triton.cdiv(n, config.block_n)
        partials = arrivals = y  # never touched without a split
        if config.split_k > 1:
            partials = torch.empty(
                tiles * config.split_k * config.block_n * MAX_ROWS,
                dtype=torch.float32,
                device=x.device,
            )
            arrivals = _arrivals(x.device, tiles)
        k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
        _gemv_kernel[(tiles, config.split_k)](
            x,
            weight,
            weight if bias is None else bias,  # never read without HAS_BIAS
            y,
            partials,
            arrivals,
            num_rows,
            n,
            k,
            k_per_split,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            BLOCK_M=MAX_ROWS,
            SPLIT_K=config.split_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return y
