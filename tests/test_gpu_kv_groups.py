"""KV cache groups on CUDA, bf16, CUDA graphs on: Gemma 3 (five local sliding-window
groups and a global one) and a Bamba of five attention layers to one Mamba layer (five
attention groups beside a state group), so the captured decode graphs read a block table
per group. Extensible equals legacy exactly, the local groups release blocks out of
their window, and greedy follows transformers up to logit ties."""

from __future__ import annotations

from pathlib import Path

import pytest

from extkv import LLM
from helpers import (
    HF_GROUPS,
    SMALL_VOCAB,
    assert_follows_transformers_in_bf16,
    extkv_tokens,
    greedy,
    prompts_growing_by,
    small_bf16_checkpoint,
)

pytestmark = pytest.mark.gpu

WINDOW = 32
MODELS = {
    "gemma3": dict(
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=WINDOW,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
    ),
    "bamba": dict(
        num_hidden_layers=6,
        attn_layer_indices=[0, 1, 2, 4, 5],
        mamba_n_heads=16,
        mamba_d_head=32,
        mamba_n_groups=HF_GROUPS,
    ),
}
KINDS = {
    "gemma3": ["sliding_window"] * 5 + ["full_attention"],
    "bamba": ["full_attention"] * 5 + ["mamba"],
}
OPTIONS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)


def build(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_bf16_checkpoint(tmp_path_factory.mktemp(family), family, **MODELS[family])


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    return request.param, build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("gemma3", tmp_path_factory)


def test_extensible_equals_legacy_with_cuda_graphs(checkpoint: tuple[str, Path]) -> None:
    family, path = checkpoint
    ids = prompts_growing_by(23, 12, SMALL_VOCAB)  # 5 to 258 tokens: most past the window
    legacy = LLM(path, **OPTIONS)
    runner = legacy.engine.runner
    assert runner.graphs is not None and runner.graphs.graphs
    kinds = [g.kind for g in runner.kv_plan.groups]
    assert kinds == KINDS[family]
    expected = extkv_tokens(legacy, ids, greedy(48))
    legacy.close()
    extensible = LLM(path, enable_extensible_kv_cache=True, **OPTIONS)
    report = extensible.memory_report()
    assert [g["kind"] for g in report["kv_cache_groups"]] == kinds
    assert report["graph_pool_bytes"] > 0
    assert extkv_tokens(extensible, ids, greedy(48)) == expected
    blocks = extensible.engine.block_manager
    assert blocks.num_used_blocks_by_group == [0] * len(kinds)
    extensible.close()


def test_local_groups_hold_a_window_while_decoding_under_graphs(gemma3: Path) -> None:
    """A 258-token prompt and 200 tokens decoded by the graphs: each local group holds the
    blocks of its window and the new token's, the global group all of them."""
    llm = LLM(gemma3, **OPTIONS)
    engine = llm.engine
    engine.add_request(prompts_growing_by(23, 12, SMALL_VOCAB)[-1], greedy(200))
    held = []
    while engine.has_unfinished_requests():
        engine.step(finished_only=True)
        held.append(engine.block_manager.num_used_blocks_by_group)
    size = engine.runner.kv_plan.block_size
    window_blocks = -(-(WINDOW - 1 + 1) // size) + 1  # a decode step's bound
    assert max(max(h[:5]) for h in held[1:-1]) <= window_blocks
    assert max(h[5] for h in held) == -(-(258 + 200 - 1) // size)
    llm.close()


def test_greedy_follows_transformers_in_bf16(checkpoint: tuple[str, Path]) -> None:
    _, path = checkpoint
    ids = prompts_growing_by(23, 6, SMALL_VOCAB)
    llm = LLM(path, max_model_len=512, max_num_seqs=8)
    ours = extkv_tokens(llm, ids, greedy(12))
    llm.close()
    assert_follows_transformers_in_bf16(path, ids, ours)
