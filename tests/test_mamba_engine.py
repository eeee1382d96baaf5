"""Mamba2 and the Bamba hybrid through the whole engine on the CPU: state in KV
cache blocks, legacy and extensible, chunked prefill, preemption."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from extkv import LLM, SamplingParams
from helpers import extkv_tokens, make_mamba_checkpoint

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


@pytest.mark.parametrize("extensible", [False, True])
@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_greedy_matches_transformers_with_chunked_prefill(
    family: str, extensible: bool, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(family)
    expected = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    # 8 tokens a step: the 30- and 17-token prompts are prefilled in several chunks.
    llm = LLM(path, enable_extensible_kv_cache=extensible, max_num_batched_tokens=8, **OPTIONS)
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
    assert len({tuple(t) for t in expected}) == len(expected)


def test_hybrid_preemption_recomputes_the_state(bamba: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = extkv_tokens(LLM(bamba, **OPTIONS), PROMPTS, params)
    roomy = LLM(bamba, **OPTIONS)
    plan = roomy.engine.runner.kv_plan
    assert (len(plan.attention_groups), len(plan.state_groups)) == (1, 4)
    # Room for two sequences of one attention block each; the 30-token prompt grows
    # past its first block while another holds the rest, and is preempted.
    assert plan.block_size < 30 + params.max_tokens
    tight = LLM(bamba, num_gpu_blocks_override=2 * plan.blocks_per_seq(1), **OPTIONS)
    assert extkv_tokens(tight, PROMPTS, params) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_used_blocks_by_group == [0] * 5


def test_pure_mamba_with_few_blocks_queues_requests(mamba2: Path) -> None:
    """One state block per sequence and two blocks: requests wait their turn."""
    expected = extkv_tokens(LLM(mamba2, **OPTIONS), PROMPTS, GREEDY)
    tight = LLM(mamba2, num_gpu_blocks_override=2, **OPTIONS)
    assert tight.engine.runner.kv_plan.blocks_per_seq(10_000) == 1
    assert extkv_tokens(tight, PROMPTS, GREEDY) == expected
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


# Six layers, attention at these indices, the rest Mamba: the rarer kind sets the group
# size, so 5 + 1 is five one-layer attention groups (a table each) beside one state group,
# 1 + 5 one attention group beside five state groups, and 2 + 4 groups of two.
RATIOS = {
    "5+1": ([0, 1, 2, 4, 5], ["full_attention"] * 5 + ["mamba"]),
    "1+5": ([3], ["full_attention"] + ["mamba"] * 5),
    "2+4": ([1, 4], ["full_attention"] + ["mamba"] * 2),
}


@pytest.fixture(scope="module", params=list(RATIOS))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A tiny six-layer Bamba of one of RATIOS, its groups' kinds, transformers' tokens."""
    attention_layers, kinds = RATIOS[request.param]
    path = tmp_path_factory.mktemp(f"bamba{request.param}")
    make_mamba_checkpoint(path, "bamba", num_hidden_layers=6, attn_layer_indices=attention_layers)
    expected = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    assert len({tuple(t) for t in expected}) == len(expected)
    return path, kinds, expected


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_hybrid_of_any_ratio_matches_transformers(hybrid, extensible: bool) -> None:
    path, kinds, expected = hybrid
    llm = LLM(path, enable_extensible_kv_cache=extensible, max_num_batched_tokens=8, **OPTIONS)
    plan = llm.engine.runner.kv_plan
    assert [g.kind for g in plan.groups] == kinds
    size = len(plan.groups[-1].layer_names)
    assert len(llm.engine.kv_cache.config.tensors) == size  # shared by position
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
    blocks = llm.engine.block_manager
    assert blocks.num_used_blocks_by_group == [0] * len(kinds) and blocks.num_used_blocks == 0
    report = llm.memory_report()
    assert [g["kind"] for g in report["kv_cache_groups"]] == kinds
    assert sorted(n for g in report["kv_cache_groups"] for n in g["layers"]) == sorted(
        n for g in plan.groups for n in g.layer_names
    )


def test_hybrid_groups_preempt_and_recompute(hybrid) -> None:
    """Room for two short sequences: growing past its first attention block a sequence
    needs one more in every attention group, so the youngest is preempted, freeing its
    blocks in every group, and recomputed: the same tokens, nothing left held."""
    path, kinds, _ = hybrid
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = extkv_tokens(LLM(path, **OPTIONS), PROMPTS, params)
    plan = LLM(path, **OPTIONS).engine.runner.kv_plan
    tight = LLM(path, num_gpu_blocks_override=2 * plan.blocks_per_seq(1), **OPTIONS)
    assert extkv_tokens(tight, PROMPTS, params) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_used_blocks_by_group == [0] * len(kinds)
