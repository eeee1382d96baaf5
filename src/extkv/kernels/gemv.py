"""y = x @ W^T (+ bias) for the few rows of a decode step, streaming W once.

cuBLAS's kernels for 1-16 rows read the weight at a fraction of the memory
bandwidth (and split K over a second reduce kernel). Here each program owns
BLOCK_N output features for every row of x, so W is read exactly once, and
walks K in pipelined chunks. The product is taken on the tensor cores with the
operands swapped, (BLOCK_N, K) @ (K, 16): x is always padded to 16 rows, so the
layouts and the order of every row's sum are the same whatever the number of
rows (a request's outputs do not depend on the batch it is in), and the
arithmetic never limits a memory-bound loop. No atomics: bit-identical results
for the same inputs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # x's rows are padded to this: tl.dot's smallest dimension
_PROGRAMS_PER_SM = 2  # a second program per SM keeps loads in flight across the tail
_STAGE_BYTES = 16384  # bytes of W per pipeline stage: BLOCK_N * BLOCK_K * itemsize
_NUM_STAGES = 4
_INTERPRETED_SMS = 132  # the H200's, for block choices under the Triton interpreter (CPU)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    num_rows,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per BLOCK_N output features: acc (BLOCK_N, BLOCK_M) = W_tile @ x^T in fp32."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < num_rows
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_col = x_ptr + m.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        kk = start + k
        k_ok = kk < K
        w = tl.load(w_row + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_col + kk[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_blocks(n: int, k: int, itemsize: int, num_sms: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a weight of n x k elements of `itemsize` bytes.

    BLOCK_N: the widest of 64/32/16 rows that still gives every SM two programs
    (16, tl.dot's minimum, when none does: Qwen3-0.6B's N=1024 gets 64 programs).
    BLOCK_K: a fixed 16 KiB of W per pipeline stage (512 bf16 columns at BLOCK_N=16),
    so each program keeps ~3 stages (48 KiB) of loads in flight, enough to cover
    HBM latency at full bandwidth; never wider than K needs.
    """
    block_n = next(
        (b for b in (64, 32) if triton.cdiv(n, b) >= _PROGRAMS_PER_SM * num_sms), MAX_ROWS
    )
    block_k = min(_STAGE_BYTES // (itemsize * block_n), max(triton.next_power_of_2(k), 16))
    return block_n, block_k


def linear_small_batch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) @ weight (N, K)^T + bias (N,) for M <= MAX_ROWS, accumulated in fp32,
    in x's dtype: nn.Linear's forward for a decode step's few rows. Allocates only
    the output, so it can be captured in a CUDA graph."""
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
        block_n, block_k = gemv_blocks(n, k, x.element_size(), _num_sms(x.device))
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x,
            weight,
            weight if bias is None else bias,  # never read without HAS_BIAS
            y,
            num_rows,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            BLOCK_M=MAX_ROWS,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=4,
            num_stages=_NUM_STAGES,
        )
    return y
