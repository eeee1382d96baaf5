"""Mixture-of-experts models (Qwen3-MoE; DeepSeek V2/V3's routed and shared experts) on the
CPU in fp32: extkv equals transformers (logits, greedy tokens), legacy equals extensible,
the checkpoint's per-expert tensors (or transformers 5's stacked ones) fill the stacked
experts or fail naming the tensor, and configs extkv cannot run are refused naming the
field. On CUDA the decode graphs capture the fused expert kernels and give eager's and the
CPU's tokens. (Two ranks: test_moe_tensor_parallel.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from extkv import LLM
from extkv.demo import make_random_checkpoint
from extkv.models import Qwen3MoeForCausalLM
from extkv.models.loader import load_model
from extkv.models.moe import MixtureOfExperts
from helpers import (
    GREEDY_16,
    QWEN3_MOE,
    TINY_ENGINE,
    TINY_ENGINE_CPU,
    TINY_ENGINE_CUDA,
    assert_legacy_equals_extensible,
    extkv_logits,
    extkv_tokens,
    hf_greedy,
    hf_logits,
    moe_checkpoint,
)

MODELS = ("qwen3-moe", "deepseek-v2-moe", "deepseek-v3-moe")


@pytest.fixture(scope="module", params=MODELS)
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


PROMPTS = [[5, 6, 7, 8, 9, 100, 200], list(range(30, 75)), [300, 12, 7]]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False},
        {"num_experts_per_tok": 8, "attention_bias": True, "tie_word_embeddings": False},
    ],
    ids=["mlp-only-layer", "sparse-step-unnormalised", "all-experts-bias-untied"],
)
def test_qwen3_moe_logits_match_transformers(tmp_path: Path, overrides: dict) -> None:
    make_random_checkpoint(tmp_path, "qwen3_moe", with_tokenizer=False, **QWEN3_MOE | overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    routed = [isinstance(layer.mlp, MixtureOfExperts) for layer in model.model.layers]
    hf_routed = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert routed == hf_routed and any(routed) and not all(routed)
    token_ids = [torch.tensor(p) for p in PROMPTS]
    torch.testing.assert_close(
        extkv_logits(model, token_ids), hf_logits(hf, token_ids), rtol=1e-4, atol=1e-4
    )


def test_greedy_matches_transformers(moe_model: Path) -> None:
    """Greedy tokens of several prompts (the 45-token one prefilled in chunks of 32 and 13,
    then 16 decode steps each) equal transformers'."""
    expected = hf_greedy(
        moe_model, PROMPTS, GREEDY_16.max_tokens, min_new_tokens=GREEDY_16.min_tokens
    )
    llm = LLM(moe_model, enable_extensible_kv_cache=True, **TINY_ENGINE)
    assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    assert len({tuple(t) for t in expected}) > 1  # the model does not babble one token


def test_qwen3_moe_sliding_window_matches_transformers(tmp_path: Path) -> None:
    """With use_sliding_window every layer attends over the last 8 tokens (the prompts and
    their generations are longer), as transformers'."""
    window = dict(use_sliding_window=True, sliding_window=8)
    make_random_checkpoint(tmp_path, "qwen3_moe", with_tokenizer=False, **QWEN3_MOE, **window)
    expected = hf_greedy(
        tmp_path, PROMPTS, GREEDY_16.max_tokens, min_new_tokens=GREEDY_16.min_tokens
    )
    llm = LLM(tmp_path, **TINY_ENGINE)
    assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    unwindowed = moe_checkpoint(tmp_path / "unwindowed", "qwen3-moe")  # the same weights
    assert extkv_tokens(LLM(unwindowed, **TINY_ENGINE), PROMPTS, GREEDY_16) != expected


def test_legacy_and_extensible_are_identical(moe_model: Path) -> None:
    assert_legacy_equals_extensible(moe_model, PROMPTS)


def test_per_expert_tensors_fill_the_stacked_experts(tmp_path: Path) -> None:
    """Expert e's gate, up and down land in row e of the stacked weights (gate rows then up
    rows); a missing or misshapen expert tensor is an error naming it, and so are the
    stacked experts given both whole and per expert."""
    moe_checkpoint(tmp_path, "qwen3-moe")
    tensors = load_file(tmp_path / "model.safetensors")
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    experts = model.model.layers[2].mlp.experts
    prefix = "model.layers.2.mlp.experts.5."
    gate, up = (tensors[f"{prefix}{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(experts.gate_up_proj[5], torch.cat((gate, up)))
    assert torch.equal(experts.down_proj[5], tensors[f"{prefix}down_proj.weight"])
    file = tmp_path / "model.safetensors"
    stacked_down = "model.layers.2.mlp.experts.down_proj"
    save_file({**tensors, stacked_down: experts.down_proj.detach().clone()}, file)
    with pytest.raises(ValueError, match=rf"given both whole and in parts: {stacked_down}$"):
        load_model(tmp_path, torch.float32, "cpu")
    save_file({**tensors, f"{prefix}up_proj.weight": gate[:, 1:].clone()}, file)
    with pytest.raises(ValueError, match=rf"{prefix}up_proj.weight in .*: shape \(32, 63\)"):
        load_model(tmp_path, torch.float32, "cpu")
    del tensors[f"{prefix}down_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=rf"missing tensors: {prefix}down_proj.weight$"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("moe_model", ["qwen3-moe"], indirect=True)
def test_load_weights_fills_the_stacked_experts(moe_model: Path, tmp_path: Path) -> None:
    """`LLM.load_weights` with another checkpoint's tensors (experts by checkpoint name)
    gives that checkpoint's tokens."""
    other = make_random_checkpoint(tmp_path, "qwen3_moe", with_tokenizer=False, seed=1, **QWEN3_MOE)
    expected = extkv_tokens(LLM(other, **TINY_ENGINE), PROMPTS, GREEDY_16)
    llm = LLM(moe_model, **TINY_ENGINE)
    assert extkv_tokens(llm, PROMPTS, GREEDY_16) != expected
    llm.load_weights(load_file(other / "model.safetensors").items())
    assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    # transformers 5 holds the experts stacked (experts.gate_up_proj, experts.down_proj):
    # its state_dict() fills them whole, and so does a checkpoint saved that way.
    llm.load_weights(load_file(moe_model / "model.safetensors").items())
    assert extkv_tokens(llm, PROMPTS, GREEDY_16) != expected
    state = transformers.AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    llm.load_weights(state.items())
    assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    stacked = tmp_path / "stacked"
    shutil.copytree(other, stacked)
    save_file({k: v.clone() for k, v in state.items()}, stacked / "model.safetensors")
    assert extkv_tokens(LLM(stacked, **TINY_ENGINE), PROMPTS, GREEDY_16) == expected
    del state["model.layers.2.mlp.experts.down_proj"]
    save_file({k: v.clone() for k, v in state.items()}, stacked / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: model.layers.2.mlp.experts.down_proj$"):
        load_model(stacked, torch.float32, "cpu")


def tiny_config(**overrides: object) -> transformers.Qwen3MoeConfig:
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.Qwen3MoeConfig(**{**fields, **overrides})


def test_configs_extkv_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\].*got 5"):
        Qwen3MoeForCausalLM(tiny_config(num_experts_per_tok=5))
    with pytest.raises(ValueError, match=r"decoder_sparse_step must be a positive int, got 0"):
        Qwen3MoeForCausalLM(tiny_config(decoder_sparse_step=0))
    with pytest.raises(ValueError, match=r"hidden_act 'gelu' is not supported"):
        Qwen3MoeForCausalLM(tiny_config(hidden_act="gelu"))


@pytest.mark.parametrize("moe_model", ["qwen3-moe"], indirect=True)
def test_bad_fused_moe_setting_is_refused(moe_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTKV_FUSED_MOE", "on")
    with pytest.raises(ValueError, match=r"EXTKV_FUSED_MOE must be 0 .* or 1 .*, got 'on'"):
        LLM(moe_model, **TINY_ENGINE)


@pytest.mark.gpu
def test_cuda_graphs_over_fused_experts_equal_eager_and_the_cpu(moe_model: Path) -> None:
    """Decode graphs captured over the fused expert kernels give the tokens of an eager CUDA
    engine and of the CPU's reference loop."""
    expected = extkv_tokens(LLM(moe_model, **TINY_ENGINE_CPU), PROMPTS, GREEDY_16)
    for eager in (False, True):
        llm = LLM(moe_model, enforce_eager=eager, **TINY_ENGINE_CUDA)
        try:
            assert bool(llm.engine.runner.graphs and llm.engine.runner.graphs.graphs) != eager
            assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
        finally:
            llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("moe_model", ["deepseek-v3-moe"], indirect=True)
def test_cuda_reference_loop_needs_eager_decode(
    moe_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EXTKV_FUSED_MOE=0 runs the reference loop on CUDA: refused under graph capture, the
    CPU's tokens eagerly."""
    expected = extkv_tokens(LLM(moe_model, **TINY_ENGINE_CPU), PROMPTS, GREEDY_16)
    monkeypatch.setenv("EXTKV_FUSED_MOE", "0")
    with pytest.raises(RuntimeError, match="enforce_eager=True"):
        LLM(moe_model, **TINY_ENGINE_CUDA)
    llm = LLM(moe_model, enforce_eager=True, **TINY_ENGINE_CUDA)
    try:
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    finally:
        llm.close()
