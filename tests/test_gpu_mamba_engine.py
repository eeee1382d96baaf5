"""Mamba2 and the Bamba hybrid on CUDA: bf16, CUDA graphs on, extensible equals legacy
exactly, and greedy follows transformers up to logit ties."""

from __future__ import annotations

import logging
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

# Mamba width = 2 x hidden_size = heads x head dim, as transformers checks.
SHAPES = {
    "bamba": dict(
        num_hidden_layers=6,
        attn_layer_indices=[1, 4],
        mamba_n_heads=16,
        mamba_d_head=32,
        mamba_n_groups=HF_GROUPS,
    ),
    "mamba2": dict(num_hidden_layers=4, num_heads=16, head_dim=32, n_groups=HF_GROUPS),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return small_bf16_checkpoint(tmp_path_factory.mktemp(family), family, **SHAPES[family])


def test_extensible_equals_legacy_with_cuda_graphs(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = prompts_growing_by(9, 12, SMALL_VOCAB)
    options = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)
    legacy = LLM(checkpoint, **options)
    assert legacy.engine.runner.graphs is not None and legacy.engine.runner.graphs.graphs
    expected = extkv_tokens(legacy, ids, greedy(24))
    legacy.close()
    with caplog.at_level(logging.INFO, logger="extkv"):
        extensible = LLM(checkpoint, enable_extensible_kv_cache=True, **options)
    report = extensible.memory_report()
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith(f"Extended KV cache to {report['num_blocks']} blocks. ") for m in messages
    )
    assert report["kv_bytes_by_kind"] and report["graph_pool_bytes"] > 0
    assert extkv_tokens(extensible, ids, greedy(24)) == expected
    extensible.close()


def test_greedy_follows_transformers_in_bf16(checkpoint: Path) -> None:
    ids = prompts_growing_by(9, 6, SMALL_VOCAB)
    llm = LLM(checkpoint, max_model_len=512, max_num_seqs=8)
    ours = extkv_tokens(llm, ids, greedy(12))
    llm.close()
    assert_follows_transformers_in_bf16(checkpoint, ids, ours)
