"""The prefill attention kernel over a step's own K/V (prompts with nothing cached): against
the torch reference under the Triton interpreter on the CPU, against the paged kernel and
torch's SDPA on the GPU; the host-side dispatch that picks it; the engine's greedy tokens
with it on and off (EXTKV_PREFILL_ATTENTION).

Triton picks its interpreter when kernels are decorated, so the CPU checks run this file
as a script in a subprocess with `TRITON_INTERPRET=1`, leaving the pytest process (and
its GPU tests) on compiled kernels.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from extkv import LLM
from extkv.attention.metadata import AttentionMetadata, ForwardContext, get_forward_context
from extkv.attention.ops import attends_own_kv, rope_store_attention
from extkv.attention.reference import causal_attention
from extkv.demo import make_random_checkpoint
from extkv.kernels.paged_attention import Tiles, paged_attention
from extkv.kernels.prefill_attention import (
    PREFILL_TILES,
    fit_tiles,
    prefill_attention,
    rope_store_prefill_attention,
)
from extkv.models.layers import RotaryEmbedding
from helpers import (
    backport_interpreter_index_fix,
    extkv_tokens,
    greedy,
    interpreter_dots_bf16_as_numbers,
    interpreter_rounds_bf16_to_nearest,
)

SMALL = Tiles(16, 16, 4, 2)


def step_qkv(
    lens: list[int], group: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k as the engine has them (tensors of their own) and v a view of the fused qkv
    rows (its row stride the whole projection's), with the step's cu_seqlens."""
    num_q_heads = group * num_kv_heads
    qkv = torch.randn(sum(lens), num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype).to(device)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    cu_seqlens = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    return q.contiguous(), k.contiguous(), v, cu_seqlens


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Each sequence on its own, in fp32, by extkv's torch reference."""
    outs = [
        causal_attention(q[a:b].float(), k[a:b].float(), v[a:b].float(), scale, sliding_window)
        for a, b in itertools.pairwise(cu_seqlens.tolist())
    ]
    return torch.cat(outs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def check_prefill(
    lens: list[int],
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    tol: float,
    tiles: Tiles | None = SMALL,
    sliding_window: int | None = None,
    use_tma: bool | None = None,
    device: str = "cpu",
) -> None:
    """The kernel (into a NaN-poisoned output: every row must be written) against the
    reference, two KV heads; `use_tma` None: the kernel's own choice (TMA on sm90)."""
    q, k, v, cu = step_qkv(lens, group, 2, head_dim, dtype, device)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k, v, cu, max(lens), scale, sliding_window, out, tiles, use_tma)
    ref = reference(q, k, v, cu, scale, sliding_window)
    assert not out.isnan().any()
    error = relative_error(out, ref)
    assert error < tol, (lens, group, head_dim, dtype, tiles, sliding_window, use_tma, error)


def check_engine_step(
    group: int, head_dim: int, dtype: torch.dtype, tol: float, sliding_window: int | None = None
) -> None:
    """What the engine runs on CUDA for a prefill with nothing cached (Qwen3's q/k norm,
    rotary, K/V store, attention over the step's own rows) against the CPU path of
    `ops.rope_store_attention`: the same output, the same cache contents."""
    lens, num_kv_heads, block_size, num_blocks = [1, 37, 20], 2, 4, 20
    num_q_heads = group * num_kv_heads
    num_tokens = sum(lens)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    positions = torch.cat([torch.arange(n) for n in lens])
    params = {"rope_type": "default", "rope_theta": 10000.0}
    cos_sin = RotaryEmbedding(head_dim, 64, params).cos_sin_cache
    norm = (torch.randn(head_dim, dtype=dtype), torch.randn(head_dim, dtype=dtype), 1e-6)
    metadata = ForwardContext.packed_prefill(lens, "cpu").attention[0]
    metadata.slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    caches = [
        torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)
    ]
    args = (qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norm)
    scale = head_dim**-0.5
    out = rope_store_prefill_attention(*args, *caches[:2], metadata, scale, sliding_window)
    ref = rope_store_attention(*args, *caches[2:], metadata, scale, sliding_window)
    assert relative_error(out, ref.float()) < tol
    for cache, expected in zip(caches[:2], caches[2:], strict=True):
        torch.testing.assert_close(cache, expected)
        assert cache.abs().sum() > 0  # something was written


# ---------------------------------------------------------------- CPU: Triton interpreter

CPU_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# Uneven sequences: one token, across several 16-token tiles, exactly one tile, one short.
LENS = [1, 37, 70, 16, 5]


def interpreter_checks() -> dict[str, list[Callable[[], None]]]:
    checks = {}
    for dtype in (torch.float32, torch.bfloat16):
        attn = partial(check_prefill, dtype=dtype, tol=CPU_TOL[dtype])
        checks[f"causal-{str(dtype)[6:]}"] = [
            partial(attn, LENS, group, head_dim, use_tma=tma)
            for group, head_dim, tma in itertools.product((1, 2, 4), (64, 128), (False, True))
        ]
        checks[f"tiles-{str(dtype)[6:]}"] = [
            *(partial(attn, LENS, 2, 64, tiles=Tiles(m, n, 4, 2)) for m, n in ((32, 16), (16, 32))),
            partial(attn, [300, 1, 129], 2, 64, tiles=None, use_tma=True),  # PREFILL_TILES
            partial(attn, LENS, 3, 24),  # odd group, head dim not a power of two
            partial(attn, LENS, 1, 8),  # under tl.dot's 16, padded
        ]
        checks[f"window-{str(dtype)[6:]}"] = [
            partial(attn, LENS, 2, 64, tiles=tiles, sliding_window=window, use_tma=tma)
            for window, tiles, tma in (
                (1, SMALL, False),  # each query its own key only
                (13, SMALL, True),  # inside a tile
                (16, Tiles(32, 16, 4, 2), False),  # one tile wide
                (40, Tiles(16, 32, 4, 2), True),  # over tiles
                (69, SMALL, False),  # the longest sequence's length but one
                (500, SMALL, True),  # beyond every sequence
            )
        ]
        checks[f"engine-{str(dtype)[6:]}"] = [
            partial(check_engine_step, 2, 64, dtype, CPU_TOL[dtype]),
            partial(check_engine_step, 1, 32, dtype, CPU_TOL[dtype], sliding_window=9),
        ]
    return checks


@pytest.mark.parametrize(
    "checks",
    [
        f"{kind}-{dtype}"
        for kind in ("causal", "tiles", "window", "engine")
        for dtype in ("float32", "bfloat16")
    ],
)
def test_interpreted(checks: str) -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, checks], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_tiles_fit_shared_memory() -> None:
    """Head dim 128 in bf16 keeps the tiles (160 KiB); 256 halves the key tiles, fp32 at
    256 cuts them to 16 rows; three stages of 128 x 128 at head dim 128 fit (224 KiB) and
    at 256 do not (sizes as sm90's 227 KiB)."""
    cpu = torch.device("cpu")
    assert fit_tiles(PREFILL_TILES, 128, 2, cpu) == PREFILL_TILES
    assert fit_tiles(PREFILL_TILES, 256, 2, cpu) == Tiles(128, 64, 8, 2)
    assert fit_tiles(PREFILL_TILES, 256, 4, cpu) == Tiles(128, 16, 8, 2)
    three = Tiles(128, 128, 8, 3)
    assert fit_tiles(three, 128, 2, cpu) == three
    assert fit_tiles(three, 256, 2, cpu) == Tiles(128, 64, 8, 2)


def test_bad_inputs_are_refused() -> None:
    q, k, v, cu = step_qkv([4, 5], 2, 2, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value"):
        prefill_attention(q, k[:, :1].expand(-1, 3, -1), v, cu, 5, 0.1)
    with pytest.raises(ValueError, match="head_dim <= 256 in bf16, fp16 or fp32; got 32"):
        prefill_attention(q.double(), k.double(), v.double(), cu, 5, 0.1)
    with pytest.raises(ValueError, match="contiguous channels"):
        prefill_attention(q, k.transpose(0, 2).contiguous().transpose(0, 2), v, cu, 5, 0.1)
    with pytest.raises(ValueError, match=r"out must be \(9, 4, 32\) like query"):
        prefill_attention(q, k, v, cu, 5, 0.1, out=q[:, :2])


def prefill_metadata(lens: list[int], context_lens: list[int] | None = None) -> AttentionMetadata:
    """A prefill of `lens` new tokens per sequence as the runner builds it: with
    `context_lens` past them, the sequences continue cached prefixes."""
    metadata = ForwardContext.packed_prefill(lens, "cpu").attention[0]
    if context_lens is not None:
        metadata.context_lens = torch.tensor(context_lens, dtype=torch.int32)
        metadata.max_context_len = max(context_lens)
        metadata.no_cached_prefix = context_lens == lens
    return metadata


def test_dispatch_reads_own_kv_only_where_nothing_is_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host decides from the step's metadata alone: whole prompts (windowed or not)
    take the prefill kernel; a cached prefix, image key bounds, a decode, rows wider than
    256 or EXTKV_PREFILL_ATTENTION=0 keep the paged one; a bad switch value is refused."""
    monkeypatch.delenv("EXTKV_PREFILL_ATTENTION", raising=False)
    whole = prefill_metadata([7, 1, 30])
    assert attends_own_kv(whole, 128, torch.bfloat16)  # on by default
    assert attends_own_kv(whole, 256, torch.float32)
    assert not attends_own_kv(whole, 576, torch.bfloat16)  # MLA's latent rows
    assert not attends_own_kv(prefill_metadata([7, 1, 30], [7, 9, 30]), 128, torch.bfloat16)
    with_images = prefill_metadata([7, 1, 30])
    with_images.key_bounds = torch.arange(38, dtype=torch.int32)
    assert not attends_own_kv(with_images, 128, torch.bfloat16)
    decode = prefill_metadata([1, 1])
    decode.is_prefill = False
    assert not attends_own_kv(decode, 128, torch.bfloat16)
    monkeypatch.setenv("EXTKV_PREFILL_ATTENTION", "0")
    assert not attends_own_kv(whole, 128, torch.bfloat16)
    monkeypatch.setenv("EXTKV_PREFILL_ATTENTION", "1")
    assert attends_own_kv(whole, 128, torch.bfloat16)
    monkeypatch.setenv("EXTKV_PREFILL_ATTENTION", "yes")
    with pytest.raises(ValueError, match=r"EXTKV_PREFILL_ATTENTION must be 0 .* or 1 .*'yes'"):
        attends_own_kv(whole, 128, torch.bfloat16)


def test_runner_marks_prefills_with_nothing_cached(qwen3: Path) -> None:
    """What the runner tells the layers (CPU engine): whole prompts are marked, a step
    with a prompt continuing a cached prefix (prefix caching) or a long prompt's later
    chunk is not, nor is a decode."""
    options = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    llm = LLM(qwen3, enable_prefix_caching=True, cpu_memory_budget_bytes=256 << 20, **options)
    seen = []

    def record(*_: object) -> None:
        metadata = get_forward_context().attention[0]
        seen.append((metadata.is_prefill, metadata.no_cached_prefix))

    attn = llm.engine.runner.model.model.layers[0].self_attn.attn
    attn.register_forward_pre_hook(record)
    shared = list(range(40, 90))
    extkv_tokens(llm, [[*shared, 7], [1, 2, 3]], greedy(2))
    assert seen == [(True, True), (False, False)]
    seen.clear()
    extkv_tokens(llm, [[*shared, 8]], greedy(1))  # three cached blocks
    assert seen == [(True, False)]
    seen.clear()
    extkv_tokens(llm, [list(range(100, 200))], greedy(1))  # 64 + 36 new tokens
    assert seen == [(True, True), (True, False)]


# ---------------------------------------------------------------- GPU

GPU_TOL = 1e-2
QWEN3_HEADS = dict(group=2, num_kv_heads=8, head_dim=128)  # Qwen3-0.6B: 16 query heads
GPU_LENS = [1, 100, 2048, 777, 128, 4099]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """torch's causal SDPA (fp32) per sequence, GQA expanded by torch."""
    outs = []
    for a, b in itertools.pairwise(cu.tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1).float()[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=q.shape[-1] ** -0.5, enable_gqa=True
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def paged_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, lens: list[int]
) -> torch.Tensor:
    """The paged kernel on the same step: K/V written to 16-token blocks in scattered
    order, each prompt its whole context."""
    block_size = 16
    pages = [-(-n // block_size) for n in lens]
    num_blocks = sum(pages)
    order = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    k_cache = torch.empty(num_blocks, block_size, *k.shape[1:], dtype=k.dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    for s, (blocks, (a, b)) in enumerate(
        zip(order.split(pages), itertools.pairwise(cu.tolist()), strict=True)
    ):
        tables[s, : len(blocks)] = blocks
        pos = torch.arange(b - a, device="cuda")
        slots = blocks[pos // block_size].long(), pos % block_size
        k_cache[slots], v_cache[slots] = k[a:b], v[a:b]
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.empty(0, dtype=torch.int64, device="cuda"),
        cu_seqlens_q=cu,
        context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        max_seqlen_q=max(lens),
        max_context_len=max(lens),
    )
    return paged_attention(q, k_cache, v_cache, metadata, q.shape[-1] ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [True, False])
def test_against_paged_kernel_and_sdpa_gpu(use_tma: bool) -> None:
    """Qwen3-0.6B's heads in bf16 over uneven prompts up to 4099 tokens: the new kernel,
    the paged one and SDPA agree."""
    torch.manual_seed(0)
    q, k, v, cu = step_qkv(GPU_LENS, **QWEN3_HEADS, dtype=torch.bfloat16, device="cuda")
    out = prefill_attention(q, k, v, cu, max(GPU_LENS), 128**-0.5, use_tma=use_tma)
    expected = sdpa(q, k, v, cu)
    assert relative_error(out, expected) < GPU_TOL
    paged = paged_prefill(q, k, v, cu, GPU_LENS)
    assert relative_error(out, paged.float()) < GPU_TOL
    assert relative_error(paged, expected) < GPU_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shapes_gpu(group: int, head_dim: int, dtype: torch.dtype) -> None:
    """Every GQA group and head dim the dispatch sends, at the engine's default tiles
    (cut to fit for 256), TMA where the rows allow (80: pointer loads)."""
    torch.manual_seed(0)
    check_prefill([1, 300, 129, 1000], group, head_dim, dtype, GPU_TOL, None, device="cuda")


@pytest.mark.gpu
def test_fp32_gpu() -> None:
    """fp32 rows (the engine's fp32 checkpoints) at the tiles fit_tiles cuts for them."""
    torch.manual_seed(0)
    check_prefill([1, 300, 129], 2, 128, torch.float32, 1e-4, None, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 128, 1000, 4096])
@pytest.mark.parametrize("use_tma", [True, False])
def test_sliding_window_gpu(window: int, use_tma: bool) -> None:
    """One token, within a tile, one tile, several, beyond every prompt."""
    torch.manual_seed(0)
    lens = [1, 300, 129, 2000]
    check_prefill(lens, 2, 128, torch.bfloat16, GPU_TOL, None, window, use_tma, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiles", [Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3)]
)
def test_other_tiles_gpu(tiles: Tiles) -> None:
    """Tiles bench_attention's sweep tries."""
    torch.manual_seed(0)
    check_prefill(GPU_LENS, 2, 128, torch.bfloat16, GPU_TOL, tiles, device="cuda", use_tma=True)


def prefill_kernels(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of `prompts` and the names of the attention kernels the GPU ran."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        tokens = extkv_tokens(llm, prompts, greedy(12))
    names = {e.name for e in prof.events() if "attention_kernel" in e.name}
    return tokens, names


@pytest.mark.gpu
def test_engine_greedy_tokens_with_and_without_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 Qwen3 (GQA 4:2), run in fp32 (on CUDA the engine defaults to bf16, whose
    rounding differs between the two kernels: a near tie flipped one prompt's tokens): the
    same greedy tokens with the prefill kernel as with EXTKV_PREFILL_ATTENTION=0, which
    runs the paged kernel alone. Prompts sharing a prefix (prefix caching) then prefill
    on the paged kernel in either case."""
    path = make_random_checkpoint(
        tmp_path, "qwen3", with_tokenizer=False, vocab_size=2048, hidden_size=256,
        intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, initializer_range=0.1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2048, (n,), generator=gen).tolist() for n in (3, 700, 129, 1)]
    shared = [[*prompts[1][:400], 5, 6, 7], prompts[1][:300]]
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("EXTKV_PREFILL_ATTENTION", switch)
        llm = LLM(
            path, dtype="float32", max_model_len=1024, max_num_seqs=8, enable_prefix_caching=True
        )
        results[switch] = prefill_kernels(llm, prompts), prefill_kernels(llm, shared)
        llm.close()
    (tokens_on, kernels_on), (shared_on, shared_kernels_on) = results["1"]
    (tokens_off, kernels_off), (shared_off, shared_kernels_off) = results["0"]
    assert tokens_on == tokens_off
    assert shared_on == shared_off
    assert any("prefill_attention" in name for name in kernels_on)
    assert not any("prefill_attention" in name for name in kernels_off | shared_kernels_off)
    assert not any("prefill_attention" in name for name in shared_kernels_on)


if __name__ == "__main__":
    backport_interpreter_index_fix()
    interpreter_rounds_bf16_to_nearest()
    interpreter_dots_bf16_as_numbers()
    for check in interpreter_checks()[sys.argv[1]]:
        torch.manual_seed(0)
        check()
