"""Prefix caching with sliding-window layers end to end on the CPU: Gemma 3 (local layers,
window 12, beside a global one) and Mistral (every layer windowed, window 12), blocks of 8.
Prompts sharing prefixes longer and shorter than the window take the cached blocks, in one
batch or one after another, and give transformers' tokens, as with prefix caching off; a
prefix whose window blocks the pool handed out meanwhile gets a shorter hit, still right."""

from __future__ import annotations

from pathlib import Path

import pytest

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from helpers import assert_nothing_leaked, extkv_tokens, hf_greedy, make_mamba_checkpoint

WINDOW = 12
SHARED = list(range(30, 70))  # 40 tokens: five full blocks of 8, over three windows
PROMPTS = [
    [*SHARED, 7, 8, 9],
    [*SHARED, 100],  # shares 40 tokens: the window group serves its last two blocks
    [*SHARED[:20], 3, 3, 3],  # shares 16
    [*SHARED[:10], 5, 6],  # shares 8, less than a window
    [1, 2],
]
# Tokens each prompt can take from a cache holding the others: whole blocks, the last
# prompt token left to compute.
SHARED_TOKENS = [40, 40, 16, 8, 0]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SMALL = dict(cpu_memory_budget_bytes=128 << 20, max_model_len=256, block_size=8)


def assert_all_free(llm: LLM) -> None:
    """No block held in any group (and, extensible, nothing leaked in the KV cache)."""
    blocks = llm.engine.block_manager
    assert blocks.num_used_blocks_by_group == [0] * len(blocks.groups)
    if llm.engine.kv_cache.extensible:
        assert_nothing_leaked(llm)
    else:
        assert blocks.num_used_blocks == 0 and not any(blocks._refs)


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    window = {} if request.param == "gemma3" else {"sliding_window": WINDOW}
    return make_random_checkpoint(folder, request.param, with_tokenizer=False, **window)


@pytest.fixture(scope="module")
def expected(model: Path) -> list[list[int]]:
    tokens = hf_greedy(model, PROMPTS, GREEDY.max_tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the model does not babble one token
    return tokens


def test_without_prefix_caching_the_tokens_are_transformers(
    model: Path, expected: list[list[int]]
) -> None:
    llm = LLM(model, **SMALL)
    windows = {
        layer.self_attn.attn.sliding_window for layer in llm.engine.runner.model.model.layers
    }
    assert WINDOW in windows
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_one_after_another(model: Path, expected: list[list[int]], extensible: bool) -> None:
    """The first prompt's blocks, those its windows released included, serve the others."""
    llm = LLM(model, enable_prefix_caching=True, enable_extensible_kv_cache=extensible, **SMALL)
    blocks = llm.engine.block_manager
    assert blocks.windowed
    assert extkv_tokens(llm, PROMPTS[:1], GREEDY) == expected[:1]
    assert blocks.num_cached_tokens == 0
    for prompt, want, shared in zip(PROMPTS[1:], expected[1:], SHARED_TOKENS[1:], strict=True):
        before = blocks.num_cached_tokens
        assert extkv_tokens(llm, [prompt], GREEDY) == [want]
        assert blocks.num_cached_tokens - before == shared
    assert_all_free(llm)


def test_in_one_batch(model: Path, expected: list[list[int]]) -> None:
    """Cold, the batch computes everything; again, each prompt takes its own blocks."""
    llm = LLM(model, enable_prefix_caching=True, **SMALL)
    blocks = llm.engine.block_manager
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
    cold = blocks.num_cached_tokens
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
    assert blocks.num_cached_tokens - cold == 40 + 40 + 16 + 8
    assert_all_free(llm)


def test_window_blocks_handed_out_meanwhile_shorten_the_hit(
    model: Path, expected: list[list[int]]
) -> None:
    """A small pool: after the first prompt, an unrelated one takes the least recently
    freed blocks, the windows' released ones first, so the second prompt is served less
    than its 40 shared tokens (or nothing), while a full-attention group (Gemma 3's
    global layer) still caches all five blocks; the tokens stay right."""
    # The fewest blocks a 64-token sequence needs: the windowed groups' too, for one step.
    num_blocks = 24 if model.name.startswith("gemma3") else 8
    options = {**SMALL, "max_model_len": 64}
    llm = LLM(model, enable_prefix_caching=True, num_gpu_blocks_override=num_blocks, **options)
    blocks = llm.engine.block_manager
    assert extkv_tokens(llm, PROMPTS[:1], GREEDY) == expected[:1]
    extkv_tokens(llm, [[3] * 33], SamplingParams(temperature=0, max_tokens=1))
    assert blocks.num_cached_tokens == 0
    assert extkv_tokens(llm, PROMPTS[1:2], GREEDY) == expected[1:2]
    assert blocks.num_cached_tokens < 40
    full = [i for i, group in enumerate(blocks.groups) if group.sliding_window is None]
    for group in full:
        assert sum(1 for g, _ in blocks._cached if g == group) >= 5
    assert_all_free(llm)


def test_mamba_layers_are_still_refused(tmp_path: Path) -> None:
    make_mamba_checkpoint(tmp_path, "bamba")
    with pytest.raises(ValueError, match="enable_prefix_caching needs a model without Mamba"):
        LLM(tmp_path, enable_prefix_caching=True, cpu_memory_budget_bytes=128 << 20)
