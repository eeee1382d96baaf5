"""From the fused qkv projection to attention's inputs in one kernel.

Per head: optional RMSNorm (Qwen3's q/k norm), rotary embedding (rotate-half,
only the leading `rotary_dim` channels; cos/sin gathered by position from the
model's fp32 table), then q to its own tensor and k, v straight into the paged
KV cache; k also to a tensor of its own where a prefill attends over its own K/V
(extkv.kernels.prefill_attention, which reads v from qkv). In torch this is a dozen
small kernels per layer plus a store; the cache views are addressed through their
strides, so every layout takes the same kernel. Roundings follow Hugging Face's op
order in the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.pdl import pdl_launch, wait_for_previous_grid

_TILE_ELEMENTS = 512  # (heads, head_dim) elements per program


@triton.jit
def _rounded(x, like_ptr):
    """fp32 `x` rounded to the dtype `like_ptr` points to: where torch stores an
    intermediate in the model dtype, so must the kernel."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def rope_factors(cos_sin_ptr, dim, ROTARY_DIM: tl.constexpr):
    """What `rotate` needs of the rotary table for channels `dim`: each channel's
    rotate-half partner, and cos and sin at the row's position (the fp32 table's row at
    `cos_sin_ptr`). Loads of a constant table only, so a kernel may issue them before it
    waits for the kernel that writes the row (`norm_pair` likewise)."""
    half = ROTARY_DIM // 2
    rotating = dim < ROTARY_DIM
    partner = tl.where(rotating, tl.where(dim < half, dim + half, dim - half), dim)
    freq = tl.where(dim < half, dim, dim - half)
    cos = tl.load(cos_sin_ptr + freq, mask=rotating, other=0.0)
    sin = tl.load(cos_sin_ptr + half + freq, mask=rotating, other=0.0)
    return partner, cos, sin


@triton.jit
def norm_pair(weight_ptr, dim, partner, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """The q/k norm weight at each channel and at its partner, fp32 (ones without
    HAS_NORM)."""
    w = tl.full(dim.shape, 1.0, tl.float32)
    wp = w
    if HAS_NORM:
        in_head = dim < HEAD_DIM
        w = tl.load(weight_ptr + dim, mask=in_head, other=0.0).to(tl.float32)
        wp = tl.load(weight_ptr + partner, mask=in_head, other=0.0).to(tl.float32)
    return w, wp


@triton.jit
def rotate(
    row_ptr, head, dim, live, partner, cos, sin, w, wp, eps, HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Heads `head` of the row at `row_ptr` normed and rotated, as an fp32 tile, with the
    factors of `rope_factors` and `norm_pair`.

    Rotate-half pairs channel d with d +- ROTARY_DIM / 2; the partner is loaded
    (and normed) on its own, so no cross-lane shuffle is needed.
    """
    x = tl.load(row_ptr + head * HEAD_DIM + dim, mask=live, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + head * HEAD_DIM + partner, mask=live, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = _rounded(w * _rounded(x * rstd, row_ptr), row_ptr)
        xp = _rounded(wp * _rounded(xp * rstd, row_ptr), row_ptr)
    cos = _rounded(cos, row_ptr)
    sin = _rounded(sin, row_ptr)
    sign = tl.where(dim < ROTARY_DIM // 2, -1.0, 1.0)  # rotate_half: (-x2, x1)
    rotated = _rounded(_rounded(x * cos, row_ptr) + sign * _rounded(xp * sin, row_ptr), row_ptr)
    return tl.where(dim < ROTARY_DIM, rotated, x)


@triton.jit
def norm_rope(
    row_ptr,
    cos_sin_ptr,
    weight_ptr,
    head,
    dim,
    live,
    eps,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Heads `head` of the row at `row_ptr` normed and rotated, as an fp32 tile: `rotate`
    with the factors loaded here."""
    partner, cos, sin = rope_factors(cos_sin_ptr, dim, ROTARY_DIM)
    w, wp = norm_pair(weight_ptr, dim, partner, HEAD_DIM, HAS_NORM)
    return rotate(
        row_ptr, head, dim, live, partner, cos, sin, w, wp, eps, HEAD_DIM, ROTARY_DIM, HAS_NORM
    )


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qkv,
    stride_cos_sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    Q_TILES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    K_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program per (token, tile of HEADS heads): q tiles first, then k/v tiles.
    K_OUT: k also goes to `k_out_ptr` (T, Hkv, D), padding tokens (slot -1) included."""
    wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    rows = tl.arange(0, HEADS)[:, None]
    dim = tl.arange(0, DIM_P2)[None, :]
    row_ptr = qkv_ptr + token * stride_qkv
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_sin_row = cos_sin_ptr + position * stride_cos_sin
    if tile < Q_TILES:
        head = tile * HEADS + rows
        live = (head < NUM_Q_HEADS) & (dim < HEAD_DIM)
        q = norm_rope(
            row_ptr, cos_sin_row, q_weight_ptr, head, dim, live, eps, HEAD_DIM, ROTARY_DIM, HAS_NORM
        )
        q_dst = q_out_ptr + token * stride_qt + head * stride_qh + dim
        tl.store(q_dst, q.to(q_out_ptr.dtype.element_ty), mask=live)
    else:
        head = (tile - Q_TILES) * HEADS + rows
        live = (head < NUM_KV_HEADS) & (dim < HEAD_DIM)
        k_row = row_ptr + NUM_Q_HEADS * HEAD_DIM
        k = norm_rope(
            k_row, cos_sin_row, k_weight_ptr, head, dim, live, eps, HEAD_DIM, ROTARY_DIM, HAS_NORM
        )
        if K_OUT:
            keys_dst = k_out_ptr + token * stride_kt + head * stride_kh + dim
            tl.store(keys_dst, k.to(k_out_ptr.dtype.element_ty), mask=live)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padding token, its slot stays untouched
            v_row = k_row + NUM_KV_HEADS * HEAD_DIM
            v = tl.load(v_row + head * HEAD_DIM + dim, mask=live)
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
            tl.store(k_dst + dim * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=live)
            tl.store(v_dst + dim * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=live)


def check_qkv_shapes(
    qkv: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """Refuse fused qkv rows that are not `num_heads` heads of `head_dim` wide with
    contiguous columns, or a rotary table that does not fit the head."""
    if qkv.dim() != 2 or qkv.shape[1] != num_heads * head_dim or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be (T, {num_heads} heads * head_dim {head_dim}) with contiguous "
            f"columns, got shape {tuple(qkv.shape)}, strides {qkv.stride()}"
        )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim > head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"cos_sin_cache must be (positions, rotary_dim) with an even rotary_dim <= "
            f"head_dim {head_dim}, contiguous; got shape {tuple(cos_sin_cache.shape)}"
        )


def qk_norm_rope_store(
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
    slot_mapping: torch.Tensor,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split qkv (T, (Hq + 2 Hkv) * D), norm (when weights are given) and rotate q and
    k, write k and v to the caches (num_blocks, block_size, Hkv, D; any strides) at
    slot_mapping (-1 skips a token), and k to `keys` (T, Hkv, D; contiguous channels)
    where given, every token's. Returns q (T, Hq, D) in qkv's dtype.

    cos_sin_cache (max_position, rotary_dim): cos then sin of each frequency, fp32.
    """
    head_dim = k_cache.shape[-1]
    check_qkv_shapes(qkv, cos_sin_cache, num_q_heads + 2 * num_kv_heads, head_dim)
    num_tokens = qkv.shape[0]
    wanted = (num_tokens, num_kv_heads, head_dim)
    if keys is not None and (tuple(keys.shape) != wanted or keys.stride(2) != 1):
        raise ValueError(
            f"keys must be {wanted} with contiguous channels, got shape "
            f"{tuple(keys.shape)}, strides {keys.stride()}"
        )
    q = qkv.new_empty(num_tokens, num_q_heads, head_dim)
    if num_tokens == 0:
        return q
    dim_p2 = triton.next_power_of_2(head_dim)
    heads = min(
        triton.next_power_of_2(max(num_q_heads, num_kv_heads)), max(1, _TILE_ELEMENTS // dim_p2)
    )
    q_tiles = triton.cdiv(num_q_heads, heads)
    has_norm = q_norm_weight is not None
    _qk_norm_rope_store_kernel[(num_tokens, q_tiles + triton.cdiv(num_kv_heads, heads))](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else qkv,  # never read without HAS_NORM
        k_norm_weight if has_norm else qkv,
        q,
        q if keys is None else keys,  # never written without K_OUT
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        *q.stride()[:2],
        *(q if keys is None else keys).stride()[:2],
        *k_cache.stride(),
        *v_cache.stride(),
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        DIM_P2=dim_p2,
        ROTARY_DIM=cos_sin_cache.shape[1],
        HEADS=heads,
        Q_TILES=q_tiles,
        BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm,
        K_OUT=keys is not None,
        num_warps=4,
        **pdl_launch(qkv.device),
    )
    return q


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `qk_norm_rope_store` without a cache (the profiling run): returns q (T, Hq, D)
    and new k, v (T, Hkv, D), written as a cache of one-token blocks, token t in block t."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    k = qkv.new_empty(num_tokens, 1, num_kv_heads, head_dim)
    v = torch.empty_like(k)
    slots = torch.arange(num_tokens, device=qkv.device)
    q = qk_norm_rope_store(
        qkv,
        positions,
        cos_sin_cache,
        num_q_heads,
        num_kv_heads,
        q_norm_weight,
        k_norm_weight,
        eps,
        k,
        v,
        slots,
    )
    return q, k.squeeze(1), v.squeeze(1)
