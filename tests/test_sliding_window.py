"""Sliding-window attention (Mistral) end to end on the CPU: each query sees its last
`sliding_window` tokens, as transformers' mask; greedy tokens equal transformers' in
float32 for prompts and generations longer than the window, chunked prefill included,
legacy equal to extensible."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from helpers import extkv_tokens, hf_greedy

WINDOW = 12  # a block and a half
# Longer than the window (several blocks of 8), shorter, and one block exactly.
PROMPTS = [list(range(30, 75)), [5, 6, 7, 8, 9, 100, 200], [17] * 4, list(range(100, 129))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL = dict(cpu_memory_budget_bytes=128 << 20, max_model_len=256, block_size=8)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("mistral"), "mistral", with_tokenizer=False, sliding_window=WINDOW
    )


def extkv_greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return extkv_tokens(llm, prompts, GREEDY)


@pytest.fixture(scope="module")
def expected(mistral: Path) -> list[list[int]]:
    tokens = hf_greedy(mistral, PROMPTS, GREEDY.max_tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the model does not babble one token
    return tokens


@pytest.mark.parametrize("kv_layout", ["split", "block_major"])
@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_greedy_matches_transformers(
    mistral: Path, expected: list[list[int]], extensible: bool, kv_layout: str
) -> None:
    llm = LLM(mistral, enable_extensible_kv_cache=extensible, kv_layout=kv_layout, **SMALL)
    assert llm.engine.runner.model.model.layers[0].self_attn.attn.sliding_window == WINDOW
    assert extkv_greedy(llm) == expected


def test_chunked_prefill_sees_the_same_window(mistral: Path, expected: list[list[int]]) -> None:
    """Prompts cut into 8-token steps: each chunk's queries attend over the cached tail."""
    llm = LLM(mistral, **SMALL, max_num_batched_tokens=8, max_num_seqs=2)
    assert extkv_greedy(llm) == expected


def test_the_window_changes_the_tokens(tmp_path: Path, mistral: Path) -> None:
    """The same weights without a window attend over everything: other tokens (the test
    above would pass with the window ignored otherwise)."""
    config = transformers.AutoConfig.from_pretrained(mistral)
    config.sliding_window = None
    unbounded = tmp_path / "unbounded"
    transformers.AutoModelForCausalLM.from_pretrained(mistral, config=config).save_pretrained(
        unbounded
    )
    assert extkv_greedy(LLM(unbounded, **SMALL))[0] != extkv_greedy(LLM(mistral, **SMALL))[0]


@pytest.mark.parametrize("window", [0, -3])  # transformers refuses what is not an int
def test_a_bad_window_is_refused(tmp_path: Path, window: object) -> None:
    path = make_random_checkpoint(tmp_path, "mistral", with_tokenizer=False)
    config = (
        (path / "config.json")
        .read_text()
        .replace('"sliding_window": 16', f'"sliding_window": {str(window).lower()}')
    )
    (path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="sliding_window must be a positive int or null"):
        LLM(path, **SMALL)


def test_a_long_generation_holds_a_window_of_blocks(mistral: Path) -> None:
    """Blocks out of every window are released as the sequence runs: 45 + 150 tokens need
    25 blocks of 8 in full; once the prompt (6 blocks, in one step) is in, each decode
    holds at most 3 (the window's last 11 tokens before the new one span 2 or 3 blocks,
    the new token's block among them or one more); the tokens stay transformers'."""
    llm = LLM(mistral, **SMALL)
    manager = llm.engine.block_manager
    peak = 0
    allocate = manager.allocate

    def recording(seq, num_tokens: int) -> None:
        nonlocal peak
        allocate(seq, num_tokens)
        if seq.num_computed_tokens >= len(PROMPTS[0]):  # decoding
            peak = max(peak, manager.num_used_blocks)

    manager.allocate = recording
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 150
    assert 0 < peak <= 3, peak
    assert manager.num_used_blocks == 0
    long = LLM(mistral, **SMALL, enable_extensible_kv_cache=True)
    again = long.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    assert [out[0].outputs[0].token_ids] == hf_greedy(mistral, PROMPTS[:1], 150)
