"""Triton kernels against the torch reference: the interpreter on CPU, the real thing on GPU.

Triton picks its interpreter when kernels are decorated, so the CPU checks run
this file as a script in a subprocess with `TRITON_INTERPRET=1`, leaving the
pytest process (and its GPU tests) on compiled kernels.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

import pytest
import torch

from extkv.attention.reference import (
    paged_attention_reference,
    store_kv_reference,
    varlen_attention_reference,
)
from extkv.kernels.paged_attention import (
    DECODE_TILES,
    fit_tiles,
    paged_attention,
    varlen_attention,
)
from extkv.kernels.store_kv import store_kv
from helpers import (
    LAYOUTS,
    Batch,
    Cache,
    backport_interpreter_index_fix,
    make_batch,
    run_interpreted,
)


def image_key_bounds(
    context_lens: list[int], q_lens: list[int], images: list[list[tuple[int, int]]], device: str
) -> torch.Tensor:
    """Each new token's last visible key: its own position, or its image's last one."""
    bounds = []
    for context_len, q_len, runs in zip(context_lens, q_lens, images, strict=True):
        last = torch.arange(context_len - q_len, context_len)
        for first, length in runs:
            inside = (last >= first) & (last < first + length)
            last = torch.where(inside, first + length - 1, last)
        bounds.append(last)
    return torch.cat(bounds).to(torch.int32).to(device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def check_store_kv(layout: str, block_size: int, dtype: torch.dtype, device: str) -> None:
    """The whole buffer matches the reference's bit for bit: padding slots never written."""
    cache = Cache.random(layout, 24, block_size, 2, 32, dtype, device)
    batch = make_batch([5, 19, 40], [5, 3, 21], 24, block_size, 2, 2, 32, dtype, device)
    slots = batch.metadata.slot_mapping.clone()
    slots[::3] = -1
    expected = cache.rebased(cache.buf.clone())
    store_kv_reference(batch.key, batch.value, expected.k, expected.v, slots)
    store_kv(batch.key, batch.value, cache.k, cache.v, slots)
    assert torch.equal(cache.buf, expected.buf)


def check_attention(
    layout: str,
    block_size: int,
    group: int,
    head_dim: int,
    context_lens: list[int],
    q_lens: list[int],
    dtype: torch.dtype,
    device: str,
    tol: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    images: list[list[tuple[int, int]]] | None = None,
) -> None:
    """Kernel output (NaN-poisoned first) vs the reference in float32; with a window, the
    blocks before every query's window are poisoned too (neither side may read them).
    `images`: each sequence's (first position, length) runs whose tokens see each other
    (key bounds, as a Gemma 3 prefill has)."""
    num_kv_heads = 2
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 7
    cache = Cache.random(layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    batch = make_batch(
        context_lens,
        q_lens,
        num_blocks,
        block_size,
        group * num_kv_heads,
        num_kv_heads,
        head_dim,
        dtype,
        device,
    )
    scale = head_dim**-0.5
    if images is not None:
        batch.metadata.key_bounds = image_key_bounds(context_lens, q_lens, images, device)
    if sliding_window is not None:  # what a window frees: every block before the first seen
        md = batch.metadata
        for s, (context_len, q_len) in enumerate(zip(context_lens, q_lens, strict=True)):
            first = max(0, context_len - q_len - sliding_window + 1) // block_size
            for block in md.block_tables[s, :first].tolist():
                cache.k[block], cache.v[block] = float("nan"), float("nan")
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(
        batch.query,
        cache.k,
        cache.v,
        batch.metadata,
        scale,
        out,
        num_splits,
        sliding_window=sliding_window,
    )
    ref_cache = cache.rebased(cache.buf.float())
    ref = paged_attention_reference(
        batch.query.float(), ref_cache.k, ref_cache.v, batch.metadata, scale, sliding_window
    )
    assert not ref.isnan().any()
    assert relative_error(out, ref) < tol


def check_mla_decode(
    block_size: int, num_heads: int, row: int, dtype: torch.dtype, device: str, tol: float
) -> None:
    """MLA decode as CUDA runs it (extkv.attention.mla): each token's latent row stored as
    both K and V of one KV head by the K/V store kernel, then the paged attention kernel's
    multi-query case over those rows, the row as key and value."""
    num_blocks = 24
    batch = make_batch(
        [1, 9, 30], [1, 1, 1], num_blocks, block_size, num_heads, 1, row, dtype, device
    )
    slots = batch.metadata.slot_mapping.clone()
    slots[-1] = -1  # a padding row: nothing written
    latent = batch.key
    cache = torch.randn(num_blocks, block_size, 1, row, dtype=dtype).to(device)
    expected = cache.clone()
    store_kv_reference(latent, latent, expected, expected, slots)
    store_kv(latent, latent, cache, cache, slots)
    assert torch.equal(cache, expected)
    scale = row**-0.5
    out = paged_attention(batch.query, cache, cache, batch.metadata, scale, num_splits=2)
    ref_cache = expected.float()
    ref = paged_attention_reference(
        batch.query.float(), ref_cache, ref_cache, batch.metadata, scale
    )
    assert relative_error(out, ref) < tol


def check_varlen(group: int, dtype: torch.dtype, device: str, tol: float) -> None:
    """Packed sequences without a cache, as in the profiling run."""
    cu = torch.tensor([0, 1, 71, 84], dtype=torch.int32, device=device)
    qkv = torch.randn(84, 2 * group + 4, 32, dtype=dtype).to(device)
    query, key, value = qkv.split([2 * group, 2, 2], dim=1)
    out = varlen_attention(query, key, value, cu, 0.2)
    ref = varlen_attention_reference(query.float(), key.float(), value.float(), cu, 0.2)
    assert relative_error(out, ref) < tol


# ---------------------------------------------------------------- CPU: Triton interpreter

CPU_TOL = 1e-5
PREFILL_CPU = dict(context_lens=[21, 10, 110], q_lens=[21, 1, 40])  # no / short / long prefix
DECODE_CPU = dict(context_lens=[1, 9, 150], q_lens=[1, 1, 1])
# Images: one in a whole prompt; one begun in the cached prefix, one across the 64-token
# query tiles (longer than the window below), one at the end; a text-only sequence.
IMAGES_CPU = dict(
    context_lens=[30, 10, 150],
    q_lens=[30, 1, 140],
    images=[[(3, 8)], [], [(8, 6), (50, 30), (147, 3)]],
)


def interpreter_checks() -> dict[str, list[Callable[[], None]]]:
    on_cpu = dict(dtype=torch.float32, device="cpu")
    attn = partial(check_attention, **on_cpu, tol=CPU_TOL)
    return {
        "store_kv": [partial(check_store_kv, layout, 4, **on_cpu) for layout in LAYOUTS],
        "prefill": [
            *(partial(attn, layout, 4, 2, 32, **PREFILL_CPU) for layout in LAYOUTS),
            partial(attn, "hybrid", 16, 3, 24, **PREFILL_CPU),  # odd group, non-power-of-2 dim
        ],
        "decode": [
            *(partial(attn, layout, 4, 4, 32, **DECODE_CPU, num_splits=4) for layout in LAYOUTS),
            partial(attn, "split", 16, 1, 32, **DECODE_CPU, num_splits=1),
            partial(check_mla_decode, 4, 4, 48, **on_cpu, tol=CPU_TOL),  # rank 32 + rope 16
        ],
        "varlen": [partial(check_varlen, 2, **on_cpu, tol=CPU_TOL)],
        "images": [
            partial(attn, "split", 4, 2, 32, **IMAGES_CPU),
            partial(attn, "block_major", 16, 3, 24, **IMAGES_CPU, sliding_window=16),
        ],
        "window": [
            partial(attn, "split", 4, 2, 32, **PREFILL_CPU, sliding_window=16),
            partial(attn, "block_major", 4, 4, 32, **DECODE_CPU, num_splits=4, sliding_window=24),
            partial(attn, "split", 16, 1, 32, **DECODE_CPU, num_splits=1, sliding_window=7),
        ],
    }


def test_tiles_fit_shared_memory() -> None:
    """Head dim 128 keeps the tuned decode tiles; DeepSeek's 576-value latent rows (1024
    wide in the kernel) get fewer K/V rows and stages, down to what 64 query heads need;
    128 heads cannot fit and the error says to shard them (sizes as sm90's 227 KiB)."""
    cpu = torch.device("cpu")
    assert fit_tiles(DECODE_TILES, 16, 128, 2, cpu) == DECODE_TILES
    for heads, block_n, stages in ((16, 32, 2), (32, 32, 2), (64, 16, 2)):
        tiles = fit_tiles(DECODE_TILES, heads, 1024, 2, cpu)
        assert (tiles.block_n, tiles.num_stages) == (block_n, stages), heads
        assert (heads + stages * block_n) * 1024 * 2 <= 232448 - 4096
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        fit_tiles(DECODE_TILES, 128, 1024, 2, cpu)


@pytest.mark.parametrize("kernel", ["store_kv", "prefill", "decode", "varlen", "window", "images"])
def test_interpreted(kernel: str) -> None:
    run_interpreted(__file__, kernel, timeout=300)


# ---------------------------------------------------------------- GPU

GPU_TOL = 1e-2
PREFILL_GPU = dict(context_lens=[37, 14, 250, 128, 629], q_lens=[37, 1, 100, 64, 129])
DECODE_GPU = dict(context_lens=[1, 17, 300, 1500, 777], q_lens=[1] * 5)
bf16_gpu = dict(dtype=torch.bfloat16, device="cuda", tol=GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_gpu(layout: str, block_size: int) -> None:
    check_store_kv(layout, block_size, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_attention_gpu(step: str, layout: str, block_size: int, group: int) -> None:
    lens = PREFILL_GPU if step == "prefill" else DECODE_GPU
    check_attention(layout, block_size, group, 128, **lens, **bf16_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [8, 64])  # 8: below tl.dot's smallest K, padded to 16
def test_attention_gpu_smaller_head_dims(step: str, layout: str, head_dim: int) -> None:
    lens = PREFILL_GPU if step == "prefill" else DECODE_GPU
    check_attention(layout, 16, 4, head_dim, **lens, **bf16_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 16])
def test_decode_splits_gpu(num_splits: int) -> None:
    check_attention("block_major", 16, 2, 128, **DECODE_GPU, **bf16_gpu, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["prefill", "decode"])
@pytest.mark.parametrize("window", [1, 100, 4096])  # one token, some blocks, all of them
@pytest.mark.parametrize("num_splits", [None, 1])
def test_sliding_window_gpu(step: str, window: int, num_splits: int | None) -> None:
    """The blocks before every window are NaN-poisoned: reading one would show."""
    lens = PREFILL_GPU if step == "prefill" else DECODE_GPU
    check_attention(
        "block_major", 16, 4, 128, **lens, **bf16_gpu, num_splits=num_splits, sliding_window=window
    )


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 16, 4096])
@pytest.mark.parametrize("group", [1, 4])
def test_image_blocks_gpu(window: int | None, group: int) -> None:
    """Images whose tokens see each other (Gemma 3's prefill): one begun in the cached
    prefix, runs across query tiles, longer and shorter than the window."""
    check_attention(
        "block_major",
        16,
        group,
        128,
        context_lens=[300, 40, 700],
        q_lens=[300, 40, 450],
        images=[[(5, 256)], [], [(200, 64), (300, 256), (690, 9)]],
        **bf16_gpu,
        sliding_window=window,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])
def test_varlen_gpu(group: int) -> None:
    check_varlen(group, **bf16_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["split", "block_major"])
def test_decode_cuda_graph(layout: str) -> None:
    """One capture replayed over new contents of every input: store + attend, as a runner does."""
    num_seqs, block_size, num_blocks, max_len = 8, 16, 512, 4096
    cache = Cache.random(layout, num_blocks, block_size, 2, 128, torch.bfloat16, "cuda")
    width = max_len // block_size  # the runner sizes block tables for the model's max length

    def batch(seed: int) -> Batch:
        torch.manual_seed(seed)
        context_lens = torch.randint(1, 1000, (num_seqs,)).tolist()
        return make_batch(
            context_lens,
            [1] * num_seqs,
            num_blocks,
            block_size,
            8,
            2,
            128,
            torch.bfloat16,
            "cuda",
            table_width=width,
        )

    static = batch(0)
    static.metadata.max_context_len = max_len

    def step() -> torch.Tensor:
        md = static.metadata
        store_kv(static.key, static.value, cache.k, cache.v, md.slot_mapping)
        return paged_attention(static.query, cache.k, cache.v, md, 0.1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for seed in (1, 2, 3):
        new = batch(seed)
        for name in ("query", "key", "value"):
            getattr(static, name).copy_(getattr(new, name))
        for name in ("slot_mapping", "context_lens", "block_tables"):
            getattr(static.metadata, name).copy_(getattr(new.metadata, name))
        expected = cache.rebased(cache.buf.clone())
        store_kv_reference(new.key, new.value, expected.k, expected.v, new.metadata.slot_mapping)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(cache.buf, expected.buf)
        ref_cache = expected.rebased(expected.buf.float())
        ref = paged_attention_reference(
            new.query.float(), ref_cache.k, ref_cache.v, new.metadata, 0.1
        )
        assert relative_error(out, ref) < GPU_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 32])
def test_mla_decode_gpu(num_heads: int) -> None:
    """DeepSeek's 576-value latent rows (kv_lora_rank 512 + rope 64); a 32-head group is
    the most whose tiles fit an H200's shared memory (sm90 compile: 200 KB, 64 heads 262)."""
    check_mla_decode(16, num_heads, 576, torch.bfloat16, "cuda", GPU_TOL)


if __name__ == "__main__":
    backport_interpreter_index_fix()
    for check in interpreter_checks()[sys.argv[1]]:
        torch.manual_seed(0)
        check()
