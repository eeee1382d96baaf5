"""Weight slices held in registers, for batch-1 kernels whose weights load before they wait.

At batch 1 a decode layer is bound by latency: a GEMV streams its weight only once the
kernel before has ended. A kernel of one program per SM can instead load its slice of
the weight into registers first, then wait (PDL), then only read its small input and
reduce (extkv.kernels.gated_mlp, extkv.kernels.norm_linear). Registers need `arange`
sizes that are powers of two, so a slice's rows and its K are each cut in two such
pieces (`two_powers`); each helper here takes or gives the two pieces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.norm import weighted_rms


def two_powers(n: int) -> tuple[int, int] | None:
    """n as a + b, a the largest power of two <= n and b a power of two or 0, else None:
    the pieces `arange` can tile n by without padding."""
    if n < 1:
        return None
    a = 1 << (n.bit_length() - 1)
    b = n - a
    return (a, b) if b & (b - 1) == 0 else None


@triton.jit
def piece(n1, n2: tl.constexpr):
    """Offsets of the second of two pieces (n2 may be 0: one dead lane) and their mask."""
    size: tl.constexpr = n2 if n2 > 0 else 1
    offsets = n1 + tl.arange(0, size)
    return offsets, tl.arange(0, size) < n2


@triton.jit
def load_slice(
    w_ptr, row0, stride, R1: tl.constexpr, R2: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr
):
    """Rows row0 .. row0 + R1 + R2 of W, as four blocks: (first/second rows) x (first/
    second K piece)."""
    r1 = row0 + tl.arange(0, R1)
    r2, r2_ok = piece(row0 + R1, R2)
    k1 = tl.arange(0, K1)
    k2, k2_ok = piece(K1, K2)
    rows1 = w_ptr + r1.to(tl.int64)[:, None] * stride
    rows2 = w_ptr + r2.to(tl.int64)[:, None] * stride
    w11 = tl.load(rows1 + k1[None, :])
    w12 = tl.load(rows1 + k2[None, :], mask=k2_ok[None, :], other=0.0)
    w21 = tl.load(rows2 + k1[None, :], mask=r2_ok[:, None], other=0.0)
    w22 = tl.load(rows2 + k2[None, :], mask=r2_ok[:, None] & k2_ok[None, :], other=0.0)
    return w11, w12, w21, w22


@triton.jit
def matvec(w11, w12, w21, w22, x1, x2):
    """(first rows, second rows) of W @ x, x in its two K pieces (fp32)."""
    y1 = tl.sum(w11.to(tl.float32) * x1[None, :], axis=1)
    y1 += tl.sum(w12.to(tl.float32) * x2[None, :], axis=1)
    y2 = tl.sum(w21.to(tl.float32) * x1[None, :], axis=1)
    y2 += tl.sum(w22.to(tl.float32) * x2[None, :], axis=1)
    return y1, y2


@triton.jit
def load_vector(ptr, K1: tl.constexpr, K2: tl.constexpr):
    """A vector of K1 + K2 elements in its two pieces, as stored."""
    k2, k2_ok = piece(K1, K2)
    return tl.load(ptr + tl.arange(0, K1)), tl.load(ptr + k2, mask=k2_ok, other=0.0)


@triton.jit
def load_rows(ptr, row0, R1: tl.constexpr, R2: tl.constexpr):
    """Elements row0 .. row0 + R1 + R2 of a vector (a bias), in its two pieces, as fp32."""
    r2, r2_ok = piece(row0 + R1, R2)
    first = tl.load(ptr + row0 + tl.arange(0, R1)).to(tl.float32)
    return first, tl.load(ptr + r2, mask=r2_ok, other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, row0, y1, y2, R1: tl.constexpr, R2: tl.constexpr):
    """Rows row0 .. row0 + R1 + R2 of a vector, given as its two pieces, in ptr's dtype."""
    r2, r2_ok = piece(row0 + R1, R2)
    tl.store(ptr + row0 + tl.arange(0, R1), y1.to(ptr.dtype.element_ty))
    tl.store(ptr + r2, y2.to(ptr.dtype.element_ty), mask=r2_ok)


@triton.jit
def store_own(ptr, v1, v2, begin, end, K1: tl.constexpr, K2: tl.constexpr):
    """Elements begin .. end of a vector held in its two pieces."""
    k1 = tl.arange(0, K1)
    k2, k2_ok = piece(K1, K2)
    tl.store(ptr + k1, v1, mask=(k1 >= begin) & (k1 < end))
    tl.store(ptr + k2, v2, mask=k2_ok & (k2 >= begin) & (k2 < end))


@triton.jit
def rms_normed_row(
    x_ptr,
    residual_ptr,
    stream_ptr,
    w1,
    w2,
    own_begin,
    own_end,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    K1: tl.constexpr,
    K2: tl.constexpr,
):
    """RMSNorm(residual + x) of one row, in its two pieces, fp32, rounded where the norm
    kernel rounds; `size` its K1 + K2 elements, `w1`, `w2` the norm weight's pieces
    (fp32). With a residual the stream residual + x is also written, elements
    own_begin .. own_end of it (every program has the whole row; each writes its own
    part)."""
    s1, s2 = load_vector(x_ptr, K1, K2)
    if HAS_RESIDUAL:
        r1, r2 = load_vector(residual_ptr, K1, K2)
        s1 = (r1.to(tl.float32) + s1.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        s2 = (r2.to(tl.float32) + s2.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        store_own(stream_ptr, s1, s2, own_begin, own_end, K1, K2)
    s1 = s1.to(x_ptr.dtype.element_ty).to(tl.float32)
    s2 = s2.to(x_ptr.dtype.element_ty).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(s1 * s1, axis=0) + tl.sum(s2 * s2, axis=0)) / size + eps)
    n1 = weighted_rms(s1, rstd, w1, x_ptr).to(tl.float32)
    return n1, weighted_rms(s2, rstd, w2, x_ptr).to(tl.float32)


def check_normed_row(
    x: torch.Tensor, width: int, residual: torch.Tensor | None, norm_weight: torch.Tensor, k: int
) -> None:
    """The shapes a one-row kernel's norm takes: x one row (1, width), residual (1, k)
    where given, norm_weight (k,); a ValueError names the operand that is off."""
    if x.shape != (1, width):
        raise ValueError(f"x must be one row (1, {width}), got {tuple(x.shape)}")
    if residual is not None and residual.shape != (1, k):
        raise ValueError(f"residual must be (1, {k}), got {tuple(residual.shape)}")
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must be ({k},), got {tuple(norm_weight.shape)}")
