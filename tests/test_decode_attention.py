"""A decode step's attention in one kernel (extkv.kernels.decode_attention) against the torch
references of what it fuses: q/k norm + rotary + KV store, then paged attention.

As in test_kernels, the CPU checks run this file as a script under the Triton interpreter
(`TRITON_INTERPRET=1`, in a subprocess); the GPU tests run the compiled kernel, eagerly,
replayed in a CUDA graph (the arrival counters must reset), and behind the dispatch (a
model's decode steps run it in test_gpu_engine and test_fused_kernels).
The cache slots of the new tokens are NaN before the call and so are the blocks before a
window: a kernel that read either from the cache (rather than the new key from registers)
would give NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from extkv.attention import ops as attention_ops
from extkv.attention.reference import paged_attention_reference, store_kv_reference
from extkv.kernels import decode_attention
from extkv.kernels.decode_attention import merge_heads, rope_store_decode_attention
from extkv.models import reference
from extkv.models.layers import RotaryEmbedding
from helpers import (
    LAYOUTS,
    Batch,
    Cache,
    backport_interpreter_index_fix,
    make_batch,
    run_interpreted,
)

NUM_KV_HEADS = 2
MAX_POSITION = 4096  # past the longest context a test draws


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def rotary_table(head_dim: int, rotary_dim: int, device: str) -> torch.Tensor:
    params = {"rope_type": "default", "rope_theta": 10000.0}
    params["partial_rotary_factor"] = rotary_dim / head_dim
    return RotaryEmbedding(head_dim, MAX_POSITION, params).cos_sin_cache.to(device)


def decode_inputs(
    layout: str,
    block_size: int,
    group: int,
    head_dim: int,
    rotary_dim: int,
    qk_norm: bool,
    context_lens: list[int],
    dtype: torch.dtype,
    device: str,
    table_width: int | None = None,
) -> tuple[Cache, Batch, tuple]:
    """A cache, a decode batch whose last row is a padding row as the engine stages it
    (slot -1, one token of block 0), and `rope_store_decode_attention`'s arguments up to
    the cache: fused qkv rows, positions, the rotary table, heads, q/k norm, eps."""
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 7
    cache = Cache.random(layout, num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, device)
    lens = [*context_lens, 1]
    num_q_heads = group * NUM_KV_HEADS
    batch = make_batch(
        lens, [1] * len(lens), num_blocks, block_size, num_q_heads, NUM_KV_HEADS, head_dim,
        dtype, device, table_width,
    )  # fmt: skip
    md = batch.metadata
    md.slot_mapping[-1] = -1
    md.block_tables[-1, 0] = 0
    qkv = torch.cat((batch.query, batch.key, batch.value), dim=1).flatten(1)
    positions = md.context_lens.long() - 1
    weights = [(1 + 0.2 * torch.randn(head_dim)).to(dtype).to(device) for _ in "qk"]
    args = (
        qkv,
        positions,
        rotary_table(head_dim, rotary_dim, device),
        num_q_heads,
        NUM_KV_HEADS,
        *(weights if qk_norm else (None, None)),
        1e-6,
    )
    return cache, batch, args


def poison(cache: Cache, batch: Batch, sliding_window: int | None) -> None:
    """NaN in the new tokens' slots and in every block before a window's first key."""
    md = batch.metadata
    for s, (slot, context_len) in enumerate(zip(md.slot_mapping, md.context_lens, strict=True)):
        if slot >= 0:
            block_size = cache.k.shape[1]
            block, offset = divmod(int(slot), block_size)
            cache.k[block, offset], cache.v[block, offset] = float("nan"), float("nan")
            if sliding_window is not None:
                first = max(0, int(context_len) - sliding_window) // block_size
                for b in md.block_tables[s, :first].tolist():
                    cache.k[b], cache.v[b] = float("nan"), float("nan")


def assert_cache_matches(cache: Cache, expected: Cache, slots: torch.Tensor) -> None:
    """The new K/V rows within the dtype's tolerance of the reference store's (in low
    precision at most 1% of their elements rounded otherwise), every other element (NaN
    poison, the padding row's slot, page padding) exactly as it was."""
    marker = cache.rebased(torch.zeros_like(cache.buf))
    ones = torch.ones(slots.numel(), *cache.k.shape[2:], dtype=cache.buf.dtype, device=slots.device)
    store_kv_reference(ones, ones, marker.k, marker.v, slots)
    written = marker.buf == 1
    torch.testing.assert_close(
        cache.buf[~written], expected.buf[~written], rtol=0, atol=0, equal_nan=True
    )
    new, ref = cache.buf[written], expected.buf[written]
    torch.testing.assert_close(new, ref)
    if ref.dtype != torch.float32:  # fp32 sums in another order differ in the last bits
        assert (new != ref).float().mean() <= 0.01, "the new K/V round otherwise than torch"


def check_decode_attention(
    layout: str,
    block_size: int,
    group: int,
    head_dim: int,
    rotary_dim: int,
    qk_norm: bool,
    context_lens: list[int],
    dtype: torch.dtype,
    device: str,
    tol: float,
    num_splits: int | None = None,
    sliding_window: int | None = None,
) -> None:
    """Output against the fp32 reference attention over the reference's cache, and the
    whole cache buffer against the reference store: written slots match within the
    dtype's rounding, every other byte (padding row, page padding) is untouched."""
    cache, batch, args = decode_inputs(
        layout, block_size, group, head_dim, rotary_dim, qk_norm, context_lens, dtype, device
    )
    poison(cache, batch, sliding_window)
    md = batch.metadata
    expected = cache.rebased(cache.buf.clone())
    q_ref = reference.qk_norm_rope_store(*args, expected.k, expected.v, md.slot_mapping)
    scale = head_dim**-0.5
    out = rope_store_decode_attention(
        *args, cache.k, cache.v, md, scale, sliding_window, num_splits=num_splits
    )
    assert_cache_matches(cache, expected, md.slot_mapping)
    ref_cache = expected.rebased(expected.buf.float())
    ref = paged_attention_reference(
        q_ref.float(), ref_cache.k, ref_cache.v, md, scale, sliding_window
    )
    real = slice(0, len(context_lens))  # the padding row's output is never read
    assert not ref[real].isnan().any()
    assert relative_error(out[real], ref[real]) < tol


# ---------------------------------------------------------------- CPU: Triton interpreter

CPU_LENS = [1, 9, 150, 77]  # the new key alone; within a tile; several tiles per split
CPU = dict(dtype=torch.float32, device="cpu", tol=1e-5)


def check_merge_in_chunks() -> None:
    """The last split merges a GQA group of 4 two heads a round trip where MERGE_ELEMENTS
    holds two heads' partials: the reference's outputs all the same."""
    saved = decode_attention.MERGE_ELEMENTS
    decode_attention.MERGE_ELEMENTS = 2 * 4 * 32
    try:
        assert merge_heads(4, 4, 32) == 2
        check_decode_attention("split", 4, 4, 32, 32, True, CPU_LENS, **CPU, num_splits=4)
    finally:
        decode_attention.MERGE_ELEMENTS = saved


def interpreter_checks() -> list[Callable[[], None]]:
    check = partial(check_decode_attention, context_lens=CPU_LENS, **CPU)
    return [
        check_merge_in_chunks,
        *(partial(check, layout, 4, 4, 32, 32, True, num_splits=4) for layout in LAYOUTS),
        partial(check, "split", 16, 1, 32, 16, False, num_splits=1),  # half rotary, no norm
        partial(check, "hybrid", 4, 3, 24, 24, True, num_splits=2),  # odd group, dim 24
        partial(check, "block_major", 4, 2, 32, 32, True, num_splits=4, sliding_window=24),
        partial(check, "split", 16, 2, 32, 32, False, num_splits=None, sliding_window=7),
    ]


def test_interpreted() -> None:
    run_interpreted(__file__, timeout=600)


def test_merge_heads() -> None:
    """A whole group (padded to a power of two) where its partials fit MERGE_ELEMENTS,
    else as many heads as fit, at least one."""
    assert merge_heads(2, 8, 128) == 2
    assert merge_heads(3, 2, 24) == 4
    assert merge_heads(8, 16, 128) == 4
    assert merge_heads(8, 16, 256) == 2
    assert merge_heads(8, 64, 256) == 1


def test_decode_attention_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default; 0 turns it off; anything else names the variable and its values."""
    monkeypatch.delenv("EXTKV_DECODE_ATTENTION", raising=False)
    assert attention_ops.decode_attention_enabled()
    monkeypatch.setenv("EXTKV_DECODE_ATTENTION", "0")
    assert not attention_ops.decode_attention_enabled()
    monkeypatch.setenv("EXTKV_DECODE_ATTENTION", "yes")
    with pytest.raises(ValueError, match=r"EXTKV_DECODE_ATTENTION must be 0 .* or 1"):
        attention_ops.decode_attention_enabled()


def test_which_steps_take_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of up to DECODE_ATTENTION_MAX_SEQS sequences with heads of up to
    DECODE_ATTENTION_MAX_HEAD_DIM, unless EXTKV_DECODE_ATTENTION=0; never a prefill."""
    monkeypatch.delenv("EXTKV_DECODE_ATTENTION", raising=False)
    most, widest = (
        attention_ops.DECODE_ATTENTION_MAX_SEQS,
        attention_ops.DECODE_ATTENTION_MAX_HEAD_DIM,
    )

    def takes(num_seqs: int, head_dim: int, prefill: bool = False) -> bool:
        _, batch, _ = decode_inputs(
            "split", 4, 1, 16, 16, False, [3] * (num_seqs - 1), torch.float32, "cpu"
        )
        batch.metadata.is_prefill = prefill
        return attention_ops.takes_decode_attention(batch.metadata, head_dim)

    assert takes(1, widest) and takes(most, 64)
    assert not takes(most + 1, 64) and not takes(1, 2 * widest) and not takes(1, 64, prefill=True)
    monkeypatch.setenv("EXTKV_DECODE_ATTENTION", "0")
    assert not takes(1, 64)


def test_refuses_a_prefill() -> None:
    """A prefill, a split count that is no power of two and query heads that no KV head
    group holds are each refused, naming what is off."""
    cache, batch, args = decode_inputs("split", 4, 2, 32, 32, True, [5, 9], torch.float32, "cpu")
    batch.metadata.is_prefill = True
    with pytest.raises(ValueError, match="one token a sequence"):
        rope_store_decode_attention(*args, cache.k, cache.v, batch.metadata, 0.1)
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        batch.metadata.is_prefill = False
        rope_store_decode_attention(*args, cache.k, cache.v, batch.metadata, 0.1, num_splits=3)
    qkv, positions, cos_sin, num_q_heads, num_kv_heads, *rest = args
    head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    one_more = torch.cat((qkv, qkv[:, :head_dim]), dim=1)  # a query head no group holds
    message = rf"num_q_heads \({num_q_heads + 1}\) must be a positive multiple of num_kv_heads"
    with pytest.raises(ValueError, match=message):
        rope_store_decode_attention(
            one_more, positions, cos_sin, num_q_heads + 1, num_kv_heads, *rest,
            cache.k, cache.v, batch.metadata, 0.1,
        )  # fmt: skip


# ---------------------------------------------------------------- GPU

GPU_LENS = [1, 17, 300, 1500, 777, 64, 65]
bf16_gpu = dict(dtype=torch.bfloat16, device="cuda", tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_attention_gpu(layout: str, block_size: int, group: int) -> None:
    check_decode_attention(layout, block_size, group, 128, 128, True, GPU_LENS, **bf16_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 8, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_attention_splits_gpu(num_splits: int, head_dim: int) -> None:
    check_decode_attention(
        "block_major", 16, 2, head_dim, head_dim, True, GPU_LENS, **bf16_gpu, num_splits=num_splits
    )


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 4096])  # one token, some blocks, all of them
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_attention_window_and_dtypes_gpu(window: int, dtype: torch.dtype) -> None:
    """Bamba's half rotary without q/k norm too."""
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    check = partial(check_decode_attention, context_lens=GPU_LENS, dtype=dtype, device="cuda")
    check("block_major", 16, 4, 128, 128, True, tol=tol, sliding_window=window)
    check("split", 16, 4, 128, 64, False, tol=tol, sliding_window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 8])
def test_decode_attention_cuda_graph(num_seqs: int) -> None:
    """One capture replayed over new contents of every input, as a runner does: the
    arrival counters reset after each merge, or a later replay's outputs stay NaN."""
    block_size, num_blocks, width = 16, 4096, 256
    cache = Cache.random("split", num_blocks, block_size, NUM_KV_HEADS, 128, torch.bfloat16, "cuda")

    def inputs(seed: int) -> tuple[Batch, tuple]:
        torch.manual_seed(seed)
        lens = torch.randint(1, 4000, (num_seqs,)).tolist()
        _, batch, args = decode_inputs(
            "split", block_size, 2, 128, 128, True, lens, torch.bfloat16, "cuda", width
        )
        return batch, args

    static, static_args = inputs(0)
    md = static.metadata

    def step() -> torch.Tensor:
        return rope_store_decode_attention(*static_args, cache.k, cache.v, md, 0.1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and make the counters outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2, 3):
        new, new_args = inputs(seed)
        for old, fresh in zip(static_args, new_args, strict=True):
            if isinstance(old, torch.Tensor):  # qkv, positions, the rotary table, q/k norms
                old.copy_(fresh)
        for name in ("slot_mapping", "context_lens", "block_tables"):
            getattr(md, name).copy_(getattr(new.metadata, name))
        expected = cache.rebased(cache.buf.clone())
        q_ref = reference.qk_norm_rope_store(
            *new_args, expected.k, expected.v, new.metadata.slot_mapping
        )
        out.fill_(float("nan"))
        graph.replay()
        ref_cache = expected.rebased(expected.buf.float())
        ref = paged_attention_reference(q_ref.float(), ref_cache.k, ref_cache.v, new.metadata, 0.1)
        real = slice(0, num_seqs)  # not the padding row
        assert relative_error(out[real], ref[real]) < 1e-2
        assert torch.equal(out, step()), "the replay and an eager call differ"


@pytest.mark.gpu
def test_dispatch_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rope_store_attention` takes the one kernel for decode steps of up to
    DECODE_ATTENTION_MAX_SEQS sequences (bit for bit its output), the three kernels beyond
    and with EXTKV_DECODE_ATTENTION=0 (bit for bit theirs)."""
    from extkv.kernels.paged_attention import paged_attention
    from extkv.kernels.rotary import qk_norm_rope_store

    def three_kernels(cache: Cache, md, args: tuple) -> torch.Tensor:
        q = qk_norm_rope_store(*args, cache.k, cache.v, md.slot_mapping)
        return paged_attention(q, cache.k, cache.v, md, 0.1)

    limit = attention_ops.DECODE_ATTENTION_MAX_SEQS
    for num_seqs, setting, one_kernel in (
        (limit, "1", True),
        (limit + 1, "1", False),
        (1, "0", False),
    ):
        monkeypatch.setenv("EXTKV_DECODE_ATTENTION", setting)
        lens = torch.randint(1, 700, (num_seqs - 1,)).tolist()  # and the padding row
        cache, batch, args = decode_inputs(
            "split", 16, 2, 128, 128, True, lens, torch.bfloat16, "cuda"
        )
        md = batch.metadata
        out = attention_ops.rope_store_attention(*args, cache.k, cache.v, md, 0.1)
        if one_kernel:
            expected = rope_store_decode_attention(*args, cache.k, cache.v, md, 0.1)
        else:
            expected = three_kernels(cache, md, args)
        assert torch.equal(out, expected), (num_seqs, setting)


if __name__ == "__main__":
    backport_interpreter_index_fix()
    from extkv.kernels import decode_attention

    # At the interpreter's head dims a tile holds every CPU context's keys: run the checks
    # again with 16-key tiles, so a split spans several (the kernel's loop over the tiles
    # after the first) and the new key is not always in the first split.
    for tile_elements in (decode_attention.TILE_ELEMENTS, 16 * 32):
        decode_attention.TILE_ELEMENTS = tile_elements
        for check in interpreter_checks():
            torch.manual_seed(0)
            check()
