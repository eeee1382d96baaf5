"""Gemma 3 (text) end to end on the CPU: local sliding-window layers between global ones,
Gemma's norms, scaled embeddings, GELU-tanh MLP and query scale; greedy tokens equal
transformers' in float32 for prompts and generations longer than the window, chunked
prefill included, legacy equal to extensible."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from helpers import extkv_tokens, hf_greedy

PROMPTS = [list(range(30, 75)), [5, 6, 7, 8, 9, 100, 200], [17] * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL = dict(cpu_memory_budget_bytes=128 << 20, max_model_len=256, block_size=8)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", with_tokenizer=False)


@pytest.fixture(scope="module")
def expected(gemma3: Path) -> list[list[int]]:
    tokens = hf_greedy(gemma3, PROMPTS, GREEDY.max_tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the model does not babble one token
    return tokens


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_greedy_matches_transformers(
    gemma3: Path, expected: list[list[int]], extensible: bool
) -> None:
    llm = LLM(gemma3, enable_extensible_kv_cache=extensible, **SMALL)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [12, None, 12]
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected


def test_chunked_prefill_matches_transformers(gemma3: Path, expected: list[list[int]]) -> None:
    llm = LLM(gemma3, **SMALL, max_num_batched_tokens=8, max_num_seqs=2)
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected


def test_local_layers_hold_a_window_of_blocks_while_the_global_one_grows(
    gemma3: Path,
) -> None:
    """Each local layer's group (window 12) releases the blocks out of its window as the
    sequence runs, the global layer's group keeps them all: 45 + 150 tokens in blocks of
    8, the global group grows to 25 blocks while each local group holds at most 3 once
    decoding (the window's 11 earlier tokens and the new one span 2 or 3 blocks); the
    tokens stay transformers', legacy and extensible alike."""
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    outputs = []
    for extensible in (False, True):
        engine = LLM(gemma3, **SMALL, enable_extensible_kv_cache=extensible).engine
        blocks = engine.block_manager
        assert [(g.kind, g.layer_names) for g in blocks.groups] == [
            ("sliding_window", ["model.layers.0.self_attn.attn"]),
            ("sliding_window", ["model.layers.2.self_attn.attn"]),
            ("full_attention", ["model.layers.1.self_attn.attn"]),
        ]
        engine.add_request(PROMPTS[0], params)
        held = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs.append(output.outputs[0].token_ids)
            held.append(blocks.num_used_blocks_by_group)
        decoding = held[1:-1]  # after the prompt's step, before the end
        assert max(local for h in decoding for local in h[:2]) == 3
        assert [h[2] for h in decoding] == sorted(h[2] for h in decoding)  # only grows
        assert max(h[2] for h in held) == -(-(45 + 150 - 1) // 8)  # the last token's KV unneeded
        assert blocks.num_used_blocks == 0 and held[-1] == [0, 0, 0]
    assert outputs[0] == outputs[1]
    assert outputs[:1] == hf_greedy(gemma3, PROMPTS[:1], 150)


def test_report_sizes_each_group(gemma3: Path) -> None:
    """The start-up report's per-group sizing: what each group keeps, of which layers, and
    what a max_model_len (256) sequence, computed 64 tokens a step, holds of the shared
    pool at most."""
    options = dict(max_num_batched_tokens=64, max_num_seqs=4)
    llm = LLM(gemma3, **SMALL, **options, enable_extensible_kv_cache=True)
    report = llm.memory_report()
    groups = report["kv_cache_groups"]
    attn = llm.engine.runner.model.model.layers[1].self_attn.attn
    page = 2 * 8 * attn.num_kv_heads * attn.head_dim * 4  # K and V of 8 tokens, fp32
    assert [(g["kind"], g["page_size_bytes"]) for g in groups] == [
        ("sliding_window", page),
        ("sliding_window", page),
        ("full_attention", page),
    ]
    assert report["bytes_per_block"] == page  # one buffer, shared by the three layers
    # Local: the window's 11 tokens before a step of up to 64, and the block it starts in.
    local = -(-(11 + 64) // 8) + 1
    assert [g["max_blocks_per_seq"] for g in groups] == [local, local, 256 // 8]
    assert [g["max_bytes_per_seq"] for g in groups] == [local * page] * 2 + [32 * page]
    assert "sliding_window=12" in groups[0]["spec"]


def test_final_logit_soft_capping_matches_transformers(tmp_path: Path, gemma3: Path) -> None:
    """tanh keeps the argmax, so the prompt's logprobs show the cap: transformers'
    log-softmax of its capped logits, to 1e-4."""
    config = transformers.AutoConfig.from_pretrained(gemma3)
    config.final_logit_softcapping = 0.5
    capped = tmp_path / "capped"
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma3, config=config)
    model.save_pretrained(capped)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    out = LLM(capped, **SMALL).generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False
    )[0]
    got = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i]
    want = [float(expected[i - 1, t]) for i, t in enumerate(prompt) if i]
    assert got == pytest.approx(want, abs=1e-4)
    # Logits within +-0.5: every logprob within 1 of log(1 / vocab), where uncapped ones are not.
    assert all(abs(w + math.log(config.vocab_size)) <= 1.0 for w in want)
    with torch.inference_mode():
        uncapped = transformers.AutoModelForCausalLM.from_pretrained(gemma3)(torch.tensor([prompt]))
    free = uncapped.logits[0].float().log_softmax(-1)
    assert any(
        abs(float(free[i - 1, t]) + math.log(config.vocab_size)) > 1.0
        for i, t in enumerate(prompt)
        if i
    )


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("hidden_activation", "silu", "hidden_activation 'silu' is not supported"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping is not supported"),
    ],
)
def test_what_the_network_lacks_is_refused(
    tmp_path: Path, gemma3: Path, field: str, value: object, words: str
) -> None:
    config = transformers.AutoConfig.from_pretrained(gemma3)
    setattr(config, field, value)
    folder = tmp_path / field
    transformers.AutoModelForCausalLM.from_pretrained(gemma3, config=config).save_pretrained(folder)
    with pytest.raises(ValueError, match=words):
        LLM(folder, **SMALL)
