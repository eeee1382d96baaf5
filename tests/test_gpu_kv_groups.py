"""KV cache groups and Mamba state on CUDA, bf16, CUDA graphs on: Gemma 3 (five local
sliding-window groups and a global one), a Bamba of five attention layers to one Mamba
layer (five attention groups beside a state group), a Bamba of two to four, and Mamba2
(state groups only), so the captured decode graphs read a block table per group.
Extensible equals legacy exactly, the local groups release blocks out of their window,
and greedy follows transformers up to logit ties."""

from __future__ import annotations

import logging
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Model:
    """A small random checkpoint's layers, and the prompts its tests run."""

    architecture: str
    shape: dict[str, object]
    prompt_step: int  # prompts of 5, 5 + step, 5 + 2 step, ... tokens
    max_tokens: int  # decoded by the extensible-equals-legacy test
    kinds: list[str]  # its KV cache groups' kinds, in the plan's order


# Six layers, those not in attn_layer_indices Mamba's. Mamba width = 2 x hidden_size =
# heads x head dim, as transformers checks.
BAMBA = dict(num_hidden_layers=6, mamba_n_heads=16, mamba_d_head=32, mamba_n_groups=HF_GROUPS)
MODELS = {
    "gemma3": Model(
        "gemma3",
        dict(
            num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            sliding_window=WINDOW,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            query_pre_attn_scalar=64,
        ),
        prompt_step=23,  # 5 to 258 tokens: most past the window
        max_tokens=48,
        kinds=["sliding_window"] * 5 + ["full_attention"],
    ),
    "bamba-5+1": Model(
        "bamba",
        {**BAMBA, "attn_layer_indices": [0, 1, 2, 4, 5]},
        prompt_step=23,
        max_tokens=48,
        kinds=["full_attention"] * 5 + ["mamba"],
    ),
    "bamba-2+4": Model(
        "bamba",
        {**BAMBA, "attn_layer_indices": [1, 4]},
        prompt_step=9,
        max_tokens=24,
        kinds=["full_attention", "mamba", "mamba"],  # two layers a group
    ),
    "mamba2": Model(
        "mamba2",
        dict(num_hidden_layers=4, num_heads=16, head_dim=32, n_groups=HF_GROUPS),
        prompt_step=9,
        max_tokens=24,
        kinds=["mamba"],
    ),
}
OPTIONS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)


def build(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = MODELS[name]
    return small_bf16_checkpoint(tmp_path_factory.mktemp(name), model.architecture, **model.shape)


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Model, Path]:
    return MODELS[request.param], build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("gemma3", tmp_path_factory)


def test_extensible_equals_legacy_with_cuda_graphs(
    checkpoint: tuple[Model, Path], caplog: pytest.LogCaptureFixture
) -> None:
    model, path = checkpoint
    ids = prompts_growing_by(model.prompt_step, 12, SMALL_VOCAB)
    legacy = LLM(path, **OPTIONS)
    runner = legacy.engine.runner
    assert runner.graphs is not None and runner.graphs.graphs
    kinds = [g.kind for g in runner.kv_plan.groups]
    assert kinds == model.kinds
    expected = extkv_tokens(legacy, ids, greedy(model.max_tokens))
    legacy.close()
    with caplog.at_level(logging.INFO, logger="extkv"):
        extensible = LLM(path, enable_extensible_kv_cache=True, **OPTIONS)
    report = extensible.memory_report()
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"Extended KV cache to {report['num_blocks']} blocks. ") for m in messages
    )
    assert [g["kind"] for g in report["kv_cache_groups"]] == kinds
    assert report["kv_bytes_by_kind"] and report["graph_pool_bytes"] > 0
    assert extkv_tokens(extensible, ids, greedy(model.max_tokens)) == expected
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


def test_greedy_follows_transformers_in_bf16(checkpoint: tuple[Model, Path]) -> None:
    model, path = checkpoint
    ids = prompts_growing_by(model.prompt_step, 6, SMALL_VOCAB)
    llm = LLM(path, max_model_len=512, max_num_seqs=8)
    ours = extkv_tokens(llm, ids, greedy(12))
    llm.close()
    assert_follows_transformers_in_bf16(path, ids, ours)


def test_prefix_caching_with_local_groups_keeps_the_tokens(gemma3: Path) -> None:
    """Prompts sharing a 200-token prefix (several windows) after it was computed, under
    the graphs and the Triton kernels: the local groups' cached window blocks serve the
    hit, their earlier table entries released; the tokens equal prefix caching off."""
    shared = prompts_growing_by(23, 12, SMALL_VOCAB)[-1][:200]
    ids = [[*shared, 5], [*shared, 6, 7, 8], [*shared[:70], 9, 9]]
    params = greedy(32)
    plain = LLM(gemma3, **OPTIONS)
    expected = extkv_tokens(plain, ids, params)
    plain.close()
    llm = LLM(gemma3, enable_prefix_caching=True, enable_extensible_kv_cache=True, **OPTIONS)
    blocks = llm.engine.block_manager
    size = blocks.block_size
    assert extkv_tokens(llm, ids[:1], params) == expected[:1]
    assert extkv_tokens(llm, ids[1:], params) == expected[1:]
    assert blocks.num_cached_tokens == 200 // size * size + 70 // size * size
    assert blocks.num_used_blocks_by_group == [0] * len(blocks.groups)
    llm.close()
