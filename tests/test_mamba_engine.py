"""Mamba2 and the Bamba hybrid through the whole engine on the CPU: state in KV
cache blocks, legacy and extensible, chunked prefill, preemption."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from extkv import LLM, SamplingParams
from helpers import make_mamba_checkpoint

# `bamba` (conftest): one attention layer among four Mamba layers, four state groups.
OPTIONS = dict(cpu_memory_budget_bytes=64 << 20, max_model_len=96, max_num_seqs=4)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [3] * 17, [100, 1, 2, 3, 4, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # extkv ignores EOS here too
    outputs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("extensible", [False, True])
@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_greedy_matches_transformers_with_chunked_prefill(
    family: str, extensible: bool, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(family)
    expected = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    # 8 tokens a step: the 30- and 17-token prompts are prefilled in several chunks.
    llm = LLM(path, enable_extensible_kv_cache=extensible, max_num_batched_tokens=8, **OPTIONS)
    assert tokens(llm, PROMPTS) == expected
    assert len({tuple(t) for t in expected}) == len(expected)


def test_hybrid_preemption_recomputes_the_state(bamba: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = tokens(LLM(bamba, **OPTIONS), PROMPTS, params)
    roomy = LLM(bamba, **OPTIONS)
    needs = roomy.engine.runner.kv_plan.needs
    assert needs.num_state_groups == 4 and needs.has_attention
    # Room for two sequences of one attention block each; the 30-token prompt grows
    # past its first block while another holds the rest, and is preempted.
    assert roomy.engine.config.block_size < 30 + params.max_tokens
    tight = LLM(bamba, num_gpu_blocks_override=2 * needs.blocks_for(1), **OPTIONS)
    assert tokens(tight, PROMPTS, params) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_used_blocks == 0


def test_pure_mamba_with_few_blocks_queues_requests(mamba2: Path) -> None:
    """One state block per sequence and two blocks: requests wait their turn."""
    expected = tokens(LLM(mamba2, **OPTIONS), PROMPTS)
    tight = LLM(mamba2, num_gpu_blocks_override=2, **OPTIONS)
    assert tight.engine.runner.kv_plan.needs.blocks_for(10_000) == 1
    assert tokens(tight, PROMPTS) == expected
    assert tight.engine.block_manager.num_used_blocks == 0


def test_hybrid_shares_pages_and_extends(bamba: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="extkv"):
        llm = LLM(bamba, enable_extensible_kv_cache=True, **OPTIONS)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Raised block_size from 16 to") for m in messages)
    report = llm.memory_report()
    assert any(
        m.startswith(f"Extended KV cache to {report['num_blocks']} blocks. ") for m in messages
    )
    # Attention and Mamba layers share every buffer, each with one segment.
    assert set(report["kv_bytes_by_kind"]) == {"attention+mamba"}
    # The plan chose the block size; the configuration is left as the user gave it.
    assert report["block_size"] == llm.engine.runner.kv_plan.block_size > 16
    assert llm.engine.config.block_size == 16
    cache = llm.engine.kv_cache
    assert all(b.memory.num_segments == 1 for b in cache._buffers)


@pytest.mark.parametrize("attention_layers", [[0, 1, 3, 4], [1, 2]])
def test_hybrid_of_any_ratio_matches_transformers(
    tmp_path: Path, attention_layers: list[int]
) -> None:
    """More attention layers than Mamba layers (4 + 1), and a ratio that leaves the last
    Mamba group short (2 + 3): attention stays one group, so one block table."""
    make_mamba_checkpoint(
        tmp_path, "bamba", num_hidden_layers=5, attn_layer_indices=attention_layers
    )
    llm = LLM(tmp_path, max_num_batched_tokens=8, **OPTIONS)
    groups = llm.engine.runner.kv_plan.groups
    assert [g.spec.kind for g in groups].count("attention") == 1
    assert tokens(llm, PROMPTS) == hf_greedy(tmp_path, PROMPTS, GREEDY.max_tokens)
