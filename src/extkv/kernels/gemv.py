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

from extkv.kernels.activation import silu_times
from extkv.kernels.arrivals import arrival_counters
from extkv.kernels.norm import weighted_rms
from extkv.kernels.pdl import pdl_launch, prefetch_to_l2, wait_for_previous_grid

MAX_ROWS = 16  # x's rows are padded to this: tl.dot's smallest dimension
_BLOCK_N = 64  # output features per program
_STAGE_BYTES = 16384  # bytes of W per pipeline stage: BLOCK_N * BLOCK_K * itemsize
_NUM_STAGES = 6
_MAX_SPLIT = 8  # slices of K per tile at most
_MIN_SLICE_STAGES = 3  # and each slice at least this many stages long
_INTERPRETED_SMS = 132  # the H200's, for block choices under the Triton interpreter (CPU)


# What the GEMV multiplies W by: x itself, silu(gate) * up of a gated MLP's (M, 2K)
# gate_up (the activation kernel fused in), or RMSNorm(x + residual) (the norm fused in).
PLAIN, SILU_AND_MUL, RMS_NORM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    partial_ptr,
    arrivals_ptr,
    residual_ptr,
    norm_weight_ptr,
    residual_out_ptr,
    w_address,
    num_rows,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    stride_rom,
    eps,
    INPUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_CHUNKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINE_ELEMENTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (i, j): acc (BLOCK_N, BLOCK_M) = W_tile @ input^T in fp32 over the j-th of
    SPLIT_K slices of K. With SPLIT_K > 1 each program leaves its partial sum in
    `partial_ptr`, and the last of a tile's programs to arrive adds them up, always in
    slice order (so the result does not depend on which one that is).

    With PREFETCH (PDL), the program's slice of W is requested into L2 before the wait
    for the previous kernel, which the weights never depend on."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < num_rows
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if PREFETCH:
        _prefetch_weight_slice(
            w_address, w_ptr, n, n_ok, k_begin, k_end, stride_wn, BLOCK_K, LINE_ELEMENTS
        )
    wait_for_previous_grid(USE_PDL)
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_col = x_ptr + m.to(tl.int64)[None, :] * stride_xm
    r_col = residual_ptr + m.to(tl.int64)[None, :] * stride_rm
    if INPUT == RMS_NORM:
        rstd = _rows_rstd(x_col, r_col, m_ok, K, eps, HAS_RESIDUAL, BLOCK_K, BLOCK_M, K_CHUNKS)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for start in range(k_begin, k_end, BLOCK_K):
        kk = start + k
        k_ok = kk < k_end
        w = tl.load(w_row + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & m_ok[None, :]
        if INPUT == SILU_AND_MUL:
            xt = _silu_and_mul_tile(x_col, kk, K, tile_ok)
        elif INPUT == RMS_NORM:
            total = _residual_sum(x_col, r_col, kk, tile_ok, HAS_RESIDUAL)
            if HAS_RESIDUAL and pid_n == 0:  # one tile column writes the new residual stream
                out = residual_out_ptr + m.to(tl.int64)[None, :] * stride_rom + kk[:, None]
                tl.store(out, total, mask=tile_ok)
            xt = _normed_tile(total, x_ptr, norm_weight_ptr, kk, m, tile_ok, rstd)
        else:
            xt = tl.load(x_col + kk[:, None], mask=tile_ok, other=0.0)
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
def _prefetch_weight_slice(
    w_address,
    w_ptr,
    n,
    n_ok,
    k_begin,
    k_end,
    stride_wn,
    BLOCK_K: tl.constexpr,
    LINE_ELEMENTS: tl.constexpr,
):
    """Request rows `n`, columns [k_begin, k_end) of W into L2, a 128-byte line at a time
    (lines outside W ask for W's first line again)."""
    item = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    lines = tl.arange(0, BLOCK_K // LINE_ELEMENTS) * LINE_ELEMENTS
    rows = w_address + n.to(tl.int64)[:, None] * stride_wn * item
    for start in range(k_begin, k_end, BLOCK_K):
        cols = start + lines
        ok = n_ok[:, None] & (cols < k_end)[None, :]
        prefetch_to_l2(tl.where(ok, rows + cols.to(tl.int64)[None, :] * item, w_address))


@triton.jit
def _silu_and_mul_tile(x_col, kk, K, tile_ok):
    """(BLOCK_K, BLOCK_M) of silu(gate) * up, gate at columns kk and up at kk + K of x,
    rounded where the activation kernel rounds."""
    gate = tl.load(x_col + kk[:, None], mask=tile_ok, other=0.0).to(tl.float32)
    up = tl.load(x_col + K + kk[:, None], mask=tile_ok, other=0.0).to(tl.float32)
    return silu_times(gate, up, x_col)


@triton.jit
def _residual_sum(x_col, r_col, kk, tile_ok, HAS_RESIDUAL: tl.constexpr):
    """(BLOCK_K, BLOCK_M) of residual + x, in the residual's dtype (x alone without one)."""
    total = tl.load(x_col + kk[:, None], mask=tile_ok, other=0.0)
    if HAS_RESIDUAL:  # one return only: Triton 3.6 types every return alike, pruned or not
        r = tl.load(r_col + kk[:, None], mask=tile_ok, other=0.0)
        total = (r.to(tl.float32) + total.to(tl.float32)).to(r_col.dtype.element_ty)
    return total


@triton.jit
def _rows_rstd(
    x_col,
    r_col,
    m_ok,
    K,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    K_CHUNKS: tl.constexpr,
):
    """(BLOCK_M,) 1 / rms of each row of residual + x (as x's dtype), over all of K.

    Unrolled over K's K_CHUNKS chunks, so every chunk's loads are in flight together:
    a rolled loop waits out one load round trip per chunk before the pipelined main loop
    can start."""
    k = tl.arange(0, BLOCK_K)
    squares = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
    for chunk in tl.static_range(K_CHUNKS):
        kk = chunk * BLOCK_K + k
        total = _residual_sum(x_col, r_col, kk, (kk < K)[:, None] & m_ok[None, :], HAS_RESIDUAL)
        total = total.to(x_col.dtype.element_ty).to(tl.float32)
        squares += total * total
    return tl.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _normed_tile(total, x_ptr, norm_weight_ptr, kk, m, tile_ok, rstd):
    """RMSNorm of a (BLOCK_K, BLOCK_M) tile of the residual sum, rounded as the norm
    kernel rounds (to x's dtype, then times the weight). The weight is loaded as a tile
    of the sum's shape (every row reads the same column), so the pipeline prefetches it
    with x instead of waiting on a load each step."""
    xf = total.to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(norm_weight_ptr + kk[:, None] + 0 * m[None, :], mask=tile_ok, other=0.0)
    return weighted_rms(xf, rstd[None, :], weight.to(tl.float32), x_ptr)


@triton.jit
def _store_output(acc, bias_ptr, y_ptr, n, m, n_ok, m_ok, stride_ym, HAS_BIAS: tl.constexpr):
    """y[m, n] = acc (BLOCK_N, BLOCK_M) + bias[n], in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@functools.cache
def num_sms(device: torch.device) -> int:
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


def _check_operands(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int
) -> None:
    """The checks every entry point shares: x (M, ...) of at most MAX_ROWS rows, W (N, k)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(
            f"the small-batch GEMV needs x (M, K) and weight (N, K), got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"the small-batch GEMV takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            "the small-batch GEMV needs x and weight with contiguous rows (stride(1) == 1)"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight's dtype {weight.dtype} must be x's ({x.dtype})")
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous ({n},), got {tuple(bias.shape)}")


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
    _check_operands(x, weight, bias, x.shape[-1])
    return _launch(x, weight, bias, config, PLAIN)


def silu_and_mul_linear_small_batch(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """`linear_small_batch(silu_and_mul(gate_up), weight, bias)` in one kernel, to the
    same bits: gate_up (M, 2K), gate then up, weight (N, K)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be (M, 2K), got {tuple(gate_up.shape)}")
    _check_operands(gate_up, weight, bias, gate_up.shape[1] // 2)
    return _launch(gate_up, weight, bias, config, SILU_AND_MUL)


def rms_norm_linear_small_batch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm(x, norm_weight, eps, residual)` then `linear_small_batch` of the normed
    rows, in one kernel: returns (y, residual stream), the stream `residual + x` in a new
    tensor (x itself without a residual). The norm rounds as the norm kernel's does; its
    sum of squares adds in another order, so y may differ from the two kernels' in the
    last bit now and then."""
    k = x.shape[-1]
    _check_operands(x, weight, bias, k)
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(
            f"residual must be x's shape {tuple(x.shape)} with contiguous rows, "
            f"got {tuple(residual.shape)}"
        )
    if norm_weight.shape != (k,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be a contiguous ({k},), got {tuple(norm_weight.shape)}")
    residual_out = x if residual is None else torch.empty_like(residual)
    norm = (residual, norm_weight, eps, residual_out)
    return _launch(x, weight, bias, config, RMS_NORM, norm), residual_out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
    input_kind: int,
    norm: tuple | None = None,
) -> torch.Tensor:
    """Run `_gemv_kernel` for checked operands; `norm` is (residual, weight, eps,
    residual_out) for RMS_NORM."""
    num_rows = x.shape[0]
    n, k = weight.shape
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if not (num_rows and n):
        return y
    sms = num_sms(x.device)
    config = config or gemv_config(n, k, x.element_size(), sms)
    tiles = triton.cdiv(n, config.block_n)
    partials = arrivals = y  # never touched without a split
    if config.split_k > 1:
        partials = torch.empty(
            tiles * config.split_k * config.block_n * MAX_ROWS,
            dtype=torch.float32,
            device=x.device,
        )
        arrivals = arrival_counters("linear_small_batch", x.device, tiles)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    residual, norm_weight, eps, residual_out = norm or (None, x, 0.0, x)
    launch = pdl_launch(x.device)
    # Prefetch only for grids of one wave: a later wave's programs start when an earlier
    # one's end, long after the wait, and would only ask for what they load next.
    prefetch = launch["USE_PDL"] and tiles * config.split_k <= sms
    _gemv_kernel[(tiles, config.split_k)](
        x,
        weight,
        weight if bias is None else bias,  # never read without HAS_BIAS
        y,
        partials,
        arrivals,
        x if residual is None else residual,  # never read without HAS_RESIDUAL
        norm_weight,
        residual_out,
        weight.data_ptr(),
        num_rows,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        0 if residual is None else residual.stride(0),
        residual_out.stride(0),
        eps,
        INPUT=input_kind,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_M=MAX_ROWS,
        SPLIT_K=config.split_k,
        K_CHUNKS=triton.cdiv(k, config.block_k) if input_kind == RMS_NORM else 1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PREFETCH=prefetch,
        LINE_ELEMENTS=min(config.block_k, 128 // x.element_size()),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch,
    )
    return y
