"""DeepSeek V2/V3 (multi-head latent attention, dense and mixture-of-experts MLPs) on the
CPU in fp32: extkv greedy equals transformers, legacy equals extensible, the KV cache holds
one latent row per token and layer, and configs extkv cannot run are refused naming the
field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from extkv import LLM, SamplingParams
from extkv.models import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, check_tensor_parallel
from extkv.models.loader import load_model
from helpers import (
    DEEPSEEK_MOE,
    GREEDY_16,
    TINY_ENGINE,
    TINY_ENGINE_CPU,
    TINY_ENGINE_CUDA,
    assert_legacy_equals_extensible,
    deepseek_checkpoint,
    extkv_logits,
    extkv_tokens,
    hf_greedy,
    hf_logits,
)

# V2-Lite's rope: YaRN with both mscales set and unequal, so the cos/sin factor and the
# softmax scale's correction both differ from 1.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,  # 4 x 256: the checkpoints' 1024 positions
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}
LATENT, ROPE = 32, 16  # demo._MLA_TINY's kv_lora_rank, qk_rope_head_dim
LAYERS = 3  # deepseek_checkpoint's
PROMPTS = [[5, 6, 7, 8, 9, 100, 200], list(range(30, 75))]


@pytest.fixture(scope="module", params=["v2", "v3"])
def deepseek(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V2: q_lora_rank None, YaRN (as V2-Lite); V3: q_lora_rank set, YaRN, interleaved rope.
    (Their mixture-of-experts layers: test_moe.)"""
    path = tmp_path_factory.mktemp(f"deepseek_{request.param}")
    return deepseek_checkpoint(path, f"deepseek_{request.param}", rope_parameters=YARN)


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("deepseek_v2", {"rope_parameters": YARN}),
        ("deepseek_v3", {"rope_parameters": YARN}),
        ("deepseek_v3", {"rope_interleave": False, "tie_word_embeddings": False}),
        ("deepseek_v3", {"q_lora_rank": None, "attention_bias": True}),
        ("deepseek_v2", DEEPSEEK_MOE),
        ("deepseek_v2", {**DEEPSEEK_MOE, "topk_method": "group_limited_greedy", "mlp_bias": True}),
        ("deepseek_v3", {**DEEPSEEK_MOE, "norm_topk_prob": False}),
    ],
    ids=[
        "v2-yarn",
        "v3-yarn",
        "v3-halves-untied",
        "v3-bias",
        "v2-moe-greedy",
        "v2-moe-groups-bias",
        "v3-moe-unnormalised",
    ],
)
def test_packed_prefill_logits_match_transformers(
    tmp_path: Path, architecture: str, overrides: dict
) -> None:
    deepseek_checkpoint(tmp_path, architecture, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    token_ids = [torch.tensor(p) for p in PROMPTS]
    torch.testing.assert_close(
        extkv_logits(model, token_ids), hf_logits(hf, token_ids), rtol=1e-4, atol=1e-4
    )


def test_multi_token_prediction_layers_are_skipped(tmp_path: Path) -> None:
    """V3 checkpoints carry layers past num_hidden_layers (MTP); other strays still fail."""
    deepseek_checkpoint(tmp_path, "deepseek_v3")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors[f"model.layers.{LAYERS}.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, file, metadata={"format": "pt"})
    load_model(tmp_path, torch.float32, "cpu")
    tensors["model.layers.0.stray.weight"] = torch.zeros(4, 4)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.stray\.weight$"):
        load_model(tmp_path, torch.float32, "cpu")


def test_greedy_and_chunked_prefill_match_transformers(deepseek: Path) -> None:
    """Greedy tokens (16 absorbed decode steps each) equal transformers'. The 45-token
    prompt goes in chunks of 32 and 13, the second attending to latents the first cached:
    its prompt logprobs equal transformers' of the whole prompt."""
    expected = hf_greedy(
        deepseek, PROMPTS, GREEDY_16.max_tokens, min_new_tokens=GREEDY_16.min_tokens
    )
    llm = LLM(deepseek, enable_extensible_kv_cache=True, **TINY_ENGINE)
    assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    assert len({tuple(t) for t in expected}) > 1  # the model does not babble one token
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [output] = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    entries = zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
    got = [entry[token].logprob for entry, token in entries]
    hf = transformers.AutoModelForCausalLM.from_pretrained(deepseek, dtype=torch.float32)
    with torch.inference_mode():
        logprobs = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    want = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)


def assert_latent_cache(llm: LLM) -> None:
    """Per token and layer the KV cache holds kv_lora_rank + qk_rope_head_dim values."""
    report = llm.memory_report()
    block_size = TINY_ENGINE["block_size"]
    assert report["bytes_per_block"] == LAYERS * block_size * (LATENT + ROPE) * 4  # fp32
    assert report["kv_cache_bytes"] >= report["num_blocks"] * report["bytes_per_block"]
    cache = llm.engine.kv_cache
    assert len(cache.layer_views) == LAYERS
    for view in cache.layer_views.values():
        assert view.shape == (cache.capacity_blocks, block_size, LATENT + ROPE)


@pytest.mark.parametrize("deepseek", ["v2"], indirect=True)
def test_legacy_and_extensible_are_identical_over_latent_caches(deepseek: Path) -> None:
    assert_legacy_equals_extensible(deepseek, PROMPTS, check=assert_latent_cache)


@pytest.mark.parametrize("deepseek", ["v3"], indirect=True)
def test_prefix_caching_keeps_outputs(deepseek: Path) -> None:
    """Later requests start from the cached latents of the shared 32-token prefix."""
    shared = list(range(100, 132))
    prompts_ = [[*shared, 1, 2, 3], [*shared, 4, 5], shared]
    plain = LLM(deepseek, **TINY_ENGINE)
    cached = LLM(deepseek, enable_prefix_caching=True, **TINY_ENGINE)
    expected = extkv_tokens(plain, prompts_, GREEDY_16)
    assert [extkv_tokens(cached, [p], GREEDY_16)[0] for p in prompts_] == expected


def tiny_config(version: str, **overrides: object) -> transformers.PretrainedConfig:
    config_class = {"v2": transformers.DeepseekV2Config, "v3": transformers.DeepseekV3Config}
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        q_lora_rank=None,
        first_k_dense_replace=2,
    )
    return config_class[version](**{**fields, **overrides})


def test_unsupported_expert_routing_is_refused() -> None:
    config = tiny_config("v2", **DEEPSEEK_MOE, topk_method="noaux_tc")
    with pytest.raises(ValueError, match=r"topk_method 'noaux_tc'.*'greedy', 'group_limited"):
        DeepseekV2ForCausalLM(config)
    config = tiny_config("v3", **{**DEEPSEEK_MOE, "n_group": None})
    with pytest.raises(ValueError, match=r"needs n_group and topk_group; got n_group=None"):
        DeepseekV3ForCausalLM(config)


def test_unsupported_rope_type_lists_the_supported_ones() -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match=r"'dynamic'.*'default', 'linear', 'llama3', 'yarn'"):
        DeepseekV3ForCausalLM(tiny_config("v3", rope_parameters=rope))


def test_heads_the_ranks_cannot_split_are_refused(tmp_path: Path) -> None:
    tiny_config("v2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_"):
        check_tensor_parallel(tmp_path, 3)


@pytest.mark.parametrize("deepseek", ["v3"], indirect=True)
def test_two_ranks_equal_one(deepseek: Path) -> None:
    """Each rank holds two of the four heads and the whole latent (gloo on the CPU)."""
    expected = extkv_tokens(LLM(deepseek, **TINY_ENGINE), PROMPTS, GREEDY_16)
    llm = LLM(deepseek, tensor_parallel_size=2, **TINY_ENGINE)
    try:
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("extensible", [False, True])
@pytest.mark.parametrize("deepseek", ["v2", "v3"], indirect=True)
def test_cuda_graphs_equal_the_cpu(deepseek: Path, extensible: bool) -> None:
    """Decode graphs captured over the latent store and the paged attention kernel (one
    KV head, the latent row as key and value) give the CPU's tokens."""
    expected = extkv_tokens(LLM(deepseek, **TINY_ENGINE_CPU), PROMPTS, GREEDY_16)
    llm = LLM(deepseek, enable_extensible_kv_cache=extensible, **TINY_ENGINE_CUDA)
    try:
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
        assert extkv_tokens(llm, PROMPTS, GREEDY_16) == expected
    finally:
        llm.close()
