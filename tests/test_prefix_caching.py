"""Prefix caching: prompts that share a prefix reuse its computed KV blocks, and
nothing about the outputs changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from extkv import LLM, SamplingParams
from helpers import extkv_tokens, make_mamba_checkpoint

OPTIONS = dict(cpu_memory_budget_bytes=256 << 20, max_model_len=256, max_num_batched_tokens=512)
SHARED = list(range(40, 90))  # 50 tokens: three full blocks of 16
PROMPTS = [[*SHARED, 7, 8, 9], [*SHARED, 100], [*SHARED[:20], 3, 3, 3], [1, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("extensible", [False, True])
def test_shared_prefixes_are_reused_and_change_nothing(qwen3: Path, extensible: bool) -> None:
    expected = extkv_tokens(LLM(qwen3, **OPTIONS), PROMPTS, GREEDY)
    llm = LLM(qwen3, enable_prefix_caching=True, enable_extensible_kv_cache=extensible, **OPTIONS)
    blocks = llm.engine.block_manager
    assert extkv_tokens(llm, PROMPTS[:1], GREEDY) == expected[:1]
    assert blocks.num_cached_tokens == 0  # nothing to reuse yet
    # The first prompt's three full blocks were remembered: the second prompt takes all
    # three (48 tokens), the third the one block it shares.
    assert extkv_tokens(llm, PROMPTS[1:], GREEDY) == expected[1:]
    assert blocks.num_cached_tokens == 48 + 16
    assert blocks.num_used_blocks == 0  # cached blocks are free, only remembered
    # A prompt that is entirely cached still computes its last token.
    assert extkv_tokens(llm, PROMPTS[:1], GREEDY) == expected[:1]
    assert blocks.num_cached_tokens == 48 + 16 + 48


def test_preemption_with_prefix_caching(qwen3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[*SHARED, i] for i in range(6)]
    expected = extkv_tokens(LLM(qwen3, **OPTIONS), prompts, params)
    tight = LLM(qwen3, enable_prefix_caching=True, num_gpu_blocks_override=16, **OPTIONS)
    assert extkv_tokens(tight, prompts, params) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_cached_tokens > 0
    assert tight.engine.block_manager.num_used_blocks == 0


def test_prefix_caching_is_refused_for_mamba_layers(tmp_path: Path) -> None:
    make_mamba_checkpoint(tmp_path, "mamba2")
    with pytest.raises(ValueError, match="enable_prefix_caching needs a model without Mamba"):
        LLM(tmp_path, enable_prefix_caching=True, **OPTIONS)


def test_bad_enable_prefix_caching(qwen3: Path) -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        LLM(qwen3, enable_prefix_caching="yes", **OPTIONS)
