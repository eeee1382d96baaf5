"""Models and loader against Hugging Face: tiny random checkpoints, packed batches, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from extkv.attention import Attention
from extkv.models import LlamaForCausalLM, load_model, model_facts
from extkv.models.hf_config import head_dim
from helpers import extkv_logits, hf_logits

LENGTHS = (5, 12, 1)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    eos_token_id=3,
)
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # wavelengths on both sides and between
}
# YaRN with an explicit attention factor (it scales cos and sin) and a ramp mid-head.
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "attention_factor": 1.3,
}


def hf_config(family: str, **overrides: object) -> transformers.PretrainedConfig:
    config_class, _, extra = FAMILIES[family]
    return config_class(**{**TINY, **extra, **overrides})


def make_checkpoint(
    path: Path, family: str, max_shard_size: str | None = None, **overrides: object
) -> transformers.PreTrainedModel:
    """Save a random HF model to `path`; every parameter random, so biases and norms count."""
    torch.manual_seed(0)
    model = FAMILIES[family][1](hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def prompts(vocab_size: int = TINY["vocab_size"]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in LENGTHS]


def rewrite_single_file(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen3", {"tie_word_embeddings": False}),
        ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
        ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_parameters": LLAMA3_ROPE}),
        ("llama", {"rope_parameters": YARN_ROPE}),
    ],
    ids=[
        "qwen3-untied",
        "qwen3-tied-bias",
        "llama-untied-bias",
        "llama-tied",
        "llama-rope3",
        "llama-yarn",
    ],
)
def test_packed_batch_matches_hf(tmp_path: Path, family: str, overrides: dict) -> None:
    hf = make_checkpoint(tmp_path, family, **overrides)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == type(hf).__name__
    tied = overrides.get("tie_word_embeddings", False)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) != tied
    token_ids = prompts()
    torch.testing.assert_close(
        extkv_logits(model, token_ids), hf_logits(hf, token_ids), rtol=1e-4, atol=1e-4
    )


def test_llama3_rope_is_not_default_rope(tmp_path: Path) -> None:
    """The llama3 case above would pass vacuously if the scaling changed nothing here."""
    make_checkpoint(tmp_path / "a", "llama", rope_parameters=LLAMA3_ROPE)
    make_checkpoint(tmp_path / "b", "llama")
    token_ids = prompts()
    scaled = extkv_logits(load_model(tmp_path / "a", torch.float32, "cpu")[0], token_ids)
    default = extkv_logits(load_model(tmp_path / "b", torch.float32, "cpu")[0], token_ids)
    assert (scaled - default).abs().max() > 0.1


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path, "qwen3", max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    token_ids = prompts()
    torch.testing.assert_close(
        extkv_logits(model, token_ids), hf_logits(hf, token_ids), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bfloat16_cast(tmp_path: Path, family: str) -> None:
    hf = make_checkpoint(tmp_path, family)
    model, _ = load_model(tmp_path, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    token_ids = prompts()
    logits = extkv_logits(model, token_ids)
    assert logits.dtype == torch.float32
    expected = hf_logits(hf.to(torch.bfloat16), token_ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0.05)


def test_tied_checkpoint_with_lm_head_uses_embeddings(tmp_path: Path) -> None:
    """A tied checkpoint that also stores lm_head.weight: HF ties it to the embedding."""
    hf = make_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
    rewrite_single_file(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(256, 64)}))
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    token_ids = prompts()
    torch.testing.assert_close(
        extkv_logits(model, token_ids), hf_logits(hf, token_ids), rtol=1e-4, atol=1e-4
    )


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    rewrite_single_file(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_lm_head_when_untied_is_named(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama", tie_word_embeddings=False)
    rewrite_single_file(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: lm_head\.weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    extra = "model.layers.0.mlp.extra_proj.weight"
    stale = "model.layers.0.self_attn.rotary_emb.inv_freq"  # old checkpoints carry it: ignored
    rewrite_single_file(tmp_path, lambda t: t.update({extra: torch.zeros(2), stale: torch.ones(8)}))
    with pytest.raises(ValueError, match=rf"unexpected tensors: {extra}$") as info:
        load_model(tmp_path, torch.float32, "cpu")
    assert "missing" not in str(info.value)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    name = "model.layers.0.mlp.up_proj.weight"
    rewrite_single_file(tmp_path, lambda t: t.update({name: torch.zeros(64, 64)}))
    with pytest.raises(ValueError, match=rf"{name}.*\(64, 64\) does not fit \(128, 64\)"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"Qwen3ForSequenceClassification.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_rope_type_is_named() -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="'dynamic'"):
        LlamaForCausalLM(hf_config("llama", rope_parameters=rope))


def test_attention_names_and_facts(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    generation_config = json.loads((tmp_path / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [3, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    model, config = load_model(tmp_path, torch.float32, "cpu")
    names = [n for n, m in model.named_modules() if isinstance(m, Attention)]
    assert names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    facts = model_facts(config, tmp_path)
    assert (facts.max_position_embeddings, facts.vocab_size) == (128, 256)
    assert facts.eos_token_ids == (3, 7)
    assert model_facts(hf_config("llama", eos_token_id=None)).eos_token_ids == ()
    assert head_dim(hf_config("llama")) == 16
    assert head_dim(config) == 32  # Qwen3's explicit head_dim, not hidden / heads
