"""Mixture-of-experts layers under tensor parallelism (gloo, two ranks on the CPU): every
rank holds every expert's slice of the intermediate features, from per-expert or stacked
tensors; Qwen3-MoE and DeepSeek-V2 (shared experts) give one rank's and transformers'
greedy tokens, legacy equals extensible, `load_weights` fills the slices, and a
`moe_intermediate_size` the ranks cannot split is refused by name. On two GPUs the fused
expert kernels, captured in the decode graphs, run on each rank's slices."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from extkv import LLM
from extkv.distributed import TPGroup
from extkv.models import check_tensor_parallel
from extkv.models.loader import load_model
from helpers import (
    GREEDY_16,
    TINY_ENGINE,
    TINY_ENGINE_CPU,
    TINY_ENGINE_CUDA,
    assert_legacy_equals_extensible,
    extkv_tokens,
    hf_greedy,
    moe_checkpoint,
)

PROMPTS = [[5, 6, 7, 8, 9, 100, 200], list(range(30, 75)), [300, 12, 7]]
TWO_RANKS = dict(TINY_ENGINE, tensor_parallel_size=2)


def two_rank_tokens(path: Path) -> list[list[int]]:
    llm = LLM(path, **TWO_RANKS)
    try:
        return extkv_tokens(llm, PROMPTS, GREEDY_16)
    finally:
        llm.close()


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v2-moe"])
def test_two_ranks_equal_one_and_transformers(model: str, tmp_path: Path) -> None:
    """Routed experts split on both ranks (and DeepSeek's shared one, in the same
    all-reduce); the prompts prefill in chunks, then decode 16 tokens."""
    path = moe_checkpoint(tmp_path, model)
    expected = hf_greedy(path, PROMPTS, GREEDY_16.max_tokens, min_new_tokens=GREEDY_16.min_tokens)
    assert len({tuple(t) for t in expected}) > 1
    assert extkv_tokens(LLM(path, **TINY_ENGINE), PROMPTS, GREEDY_16) == expected
    assert two_rank_tokens(path) == expected


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v2-moe"])
def test_legacy_equals_extensible_on_two_ranks(model: str, tmp_path: Path) -> None:
    assert_legacy_equals_extensible(
        moe_checkpoint(tmp_path, model), PROMPTS, tensor_parallel_size=2
    )


def expert_params(path: Path, rank: int) -> dict[str, torch.Tensor]:
    """The experts' parameters (routed and shared) `rank` of two loads from `path`."""
    model, _ = load_model(path, torch.float32, "cpu", TPGroup(rank, 2))
    return {n: p for n, p in model.named_parameters() if "experts" in n}


def test_each_rank_holds_its_slice_of_every_expert(tmp_path: Path) -> None:
    """Rank r holds rows [r I/2, (r+1) I/2) of every expert's gate and up (gate's first) and
    those columns of its down, from per-expert tensors and from transformers 5's stacked
    ones alike; the shared experts split as a dense MLP."""
    path = moe_checkpoint(tmp_path / "per-expert", "deepseek-v2-moe")
    tensors = load_file(path / "model.safetensors")
    half = 16 // 2  # DEEPSEEK_MOE's moe_intermediate_size over two ranks
    stacked_path = tmp_path / "stacked"
    shutil.copytree(path, stacked_path)
    state = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file({k: v.clone() for k, v in state.items()}, stacked_path / "model.safetensors")
    for rank in (0, 1):
        rows = slice(rank * half, (rank + 1) * half)
        params = expert_params(path, rank)
        prefix = "model.layers.2.mlp.experts"
        gate, up, down = (tensors[f"{prefix}.7.{p}_proj.weight"] for p in ("gate", "up", "down"))
        assert torch.equal(params[f"{prefix}.gate_up_proj"][7], torch.cat((gate[rows], up[rows])))
        assert torch.equal(params[f"{prefix}.down_proj"][7], down[:, rows])
        shared = "model.layers.2.mlp.shared_experts"
        assert torch.equal(
            params[f"{shared}.down_proj.weight"], tensors[f"{shared}.down_proj.weight"][:, rows]
        )
        from_stacked = expert_params(stacked_path, rank)
        assert from_stacked.keys() == params.keys()
        for name, param in params.items():
            assert torch.equal(from_stacked[name], param), name


def test_load_weights_on_two_ranks(tmp_path: Path) -> None:
    """`LLM.load_weights` on two ranks with another checkpoint's tensors, by per-expert
    name and stacked as transformers 5 holds them, gives that checkpoint's tokens."""
    path = moe_checkpoint(tmp_path / "first", "qwen3-moe")
    other = moe_checkpoint(tmp_path / "other", "qwen3-moe", seed=1)
    expected = extkv_tokens(LLM(other, **TINY_ENGINE), PROMPTS, GREEDY_16)
    stacked = transformers.AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    llm = LLM(path, **TWO_RANKS)
    try:
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) != expected
        llm.load_weights(load_file(other / "model.safetensors").items())
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
        llm.load_weights(load_file(path / "model.safetensors").items())
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) != expected
        llm.load_weights(stacked.items())
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    finally:
        llm.close()


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v2-moe", "deepseek-v3-moe"])
def test_intermediate_size_the_ranks_cannot_split_is_refused(model: str, tmp_path: Path) -> None:
    """Refused naming the field before any worker starts; for DeepSeek the routed experts'
    size is named, not the shared experts' (one of the same size)."""
    path = moe_checkpoint(tmp_path, model, moe_intermediate_size=15)
    match = r"tensor_parallel_size=2 must divide moe_intermediate_size \(15\)"
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(path, 2)
    with pytest.raises(ValueError, match=match):
        LLM(path, **TWO_RANKS)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v2-moe"])
def test_two_gpus_fused_experts_equal_the_cpu(model: str, tmp_path: Path) -> None:
    """NCCL, CUDA graphs over the fused kernels on half of each expert: one CPU rank's
    tokens (fp32)."""
    path = moe_checkpoint(tmp_path, model)
    expected = extkv_tokens(LLM(path, **TINY_ENGINE_CPU), PROMPTS, GREEDY_16)
    llm = LLM(path, **(TINY_ENGINE_CUDA | {"tensor_parallel_size": 2}))
    try:
        graph_pools = llm.memory_report()["graph_pool_bytes_per_rank"]
        assert len(graph_pools) == 2 and min(graph_pools) > 0
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    finally:
        llm.close()
