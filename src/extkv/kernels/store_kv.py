"""Scatter new K/V tokens into the paged cache, whatever its layout.

The cache views are addressed through their strides, so the `split`,
`block_major` and re-strided hybrid layouts all take the same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: all heads of its K and V row go to one slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: its slot must stay untouched
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    head = tl.arange(0, HEADS_P2)[:, None]
    dim = tl.arange(0, DIM_P2)[None, :]
    mask = (head < NUM_HEADS) & (dim < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
    tl.store(k_dst + dim * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + dim * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value (T, Hkv, D) to caches (num_blocks, block_size, Hkv, D) at slot_mapping.

    Slot `s` is block `s // block_size`, offset `s % block_size`; -1 skips the token.
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_heads),
        DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )
