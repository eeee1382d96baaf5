"""`LLM.load_weights` on one rank (CPU, host backend, tiny random Qwen3s of one shape): after a
level-2 sleep the weights of another checkpoint give that checkpoint's tokens without reading
any checkpoint, the first's given back give its tokens, a partial set is refused there, a bad
name, shape or dtype names the parameter and loads nothing, and the engine's state is
checked. Without sleep mode it loads in place too."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import transformers
from safetensors.torch import load_file

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from extkv.engine.errors import EngineAsleepError, EngineStateError
from helpers import extkv_tokens

OPTIONS = dict(
    cpu_memory_budget_bytes=96 << 20,
    max_model_len=128,
    max_num_batched_tokens=256,
    max_num_seqs=8,
    enable_extensible_kv_cache=True,
)
PREFIX = list(range(40, 72))  # two full blocks two prompts share (prefix caching)
PROMPTS = [[*PREFIX, 5, 6, 7], [*PREFIX, *range(100, 120)], [17] * 3, list(range(200, 241))]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
Weights = dict[str, torch.Tensor]


def checkpoint_weights(path: Path) -> Weights:
    """A checkpoint's tensors by name (its safetensors; the tied lm_head is not there)."""
    return load_file(path / "model.safetensors")


def state_dict(path: Path) -> Weights:
    """transformers' `model.state_dict()` of a checkpoint (tied lm_head.weight included)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


class Model(NamedTuple):
    path: Path
    tokens: list[list[int]]  # PROMPTS' tokens from a fresh engine on it


def fresh(path: Path) -> Model:
    llm = LLM(path, **OPTIONS)
    model = Model(path, extkv_tokens(llm, PROMPTS, PARAMS))
    llm.close()
    return model


@pytest.fixture(scope="module")
def first(qwen3: Path) -> Model:
    return fresh(qwen3)


@pytest.fixture(scope="module")
def second(tmp_path_factory: pytest.TempPathFactory, first: Model) -> Model:
    """The same shapes as `first`, other weights: other tokens."""
    model = fresh(make_random_checkpoint(tmp_path_factory.mktemp("second"), "qwen3", seed=1))
    assert model.tokens != first.tokens
    return model


@pytest.fixture(scope="module")
def llm(first: Model) -> LLM:
    """An engine on `first` with sleep mode and prefix caching, serving `first`'s weights
    between tests."""
    return LLM(first.path, enable_sleep_mode=True, enable_prefix_caching=True, **OPTIONS)


def test_load_weights_after_a_level_2_sleep_reads_no_checkpoint(
    first: Model, second: Model, tmp_path: Path
) -> None:
    served = Path(shutil.copytree(first.path, tmp_path / "served"))
    llm = LLM(served, enable_sleep_mode=True, enable_prefix_caching=True, **OPTIONS)
    try:
        assert extkv_tokens(llm, PROMPTS, PARAMS) == first.tokens
        addresses = [p.data_ptr() for p in llm.engine.runner.model.parameters()]
        (served / "model.safetensors").unlink()  # reading the checkpoint would fail now
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()
        assert llm.kv_cache_status()["weights_loaded"] is False
        llm.load_weights(state_dict(second.path).items())
        assert llm.kv_cache_status()["weights_loaded"] is True
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        assert extkv_tokens(llm, PROMPTS, PARAMS) == second.tokens
        # Awake, with the prefix cache full of the second model's KV: loading the first's
        # empties it, or PREFIX's blocks would be stale hits.
        llm.load_weights(checkpoint_weights(first.path).items())
        assert extkv_tokens(llm, PROMPTS, PARAMS) == first.tokens
        assert [p.data_ptr() for p in llm.engine.runner.model.parameters()] == addresses
    finally:
        llm.close()


def test_a_level_2_wake_reads_the_checkpoint_unless_load_weights_fills_the_parameters(
    llm: LLM, first: Model
) -> None:
    """A partial set is refused there (the parameters hold nothing); wake_up then reads the
    checkpoint; and requests wait meanwhile."""
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    some = dict(list(checkpoint_weights(first.path).items())[:3])
    with pytest.raises(
        ValueError,
        match=r"which must give every parameter \(after sleep\(level=2\) they hold nothing\), "
        r"does not match Qwen3ForCausalLM: missing tensors: model\.layers\.0\.mlp\.gate_proj",
    ):
        llm.load_weights(some.items())
    llm.wake_up(tags=["kv_cache"])  # fully awake, nothing loaded: the checkpoint is read
    assert not llm.is_sleeping() and llm.kv_cache_status()["weights_loaded"]
    assert extkv_tokens(llm, PROMPTS, PARAMS) == first.tokens


def test_a_failed_checkpoint_read_leaves_requests_refused_until_load_weights(
    first: Model, tmp_path: Path
) -> None:
    served = Path(shutil.copytree(first.path, tmp_path / "served"))
    llm = LLM(served, enable_sleep_mode=True, **OPTIONS)
    try:
        weights = checkpoint_weights(served)
        (served / "model.safetensors").unlink()
        llm.sleep(level=2)
        with pytest.raises(FileNotFoundError):
            llm.wake_up()  # maps both back, then cannot read the parameters
        assert llm.is_sleeping() and llm.kv_cache_status()["asleep"] == []
        with pytest.raises(EngineAsleepError, match=r"dropped by sleep\(level=2\) are not loaded"):
            llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
        llm.sleep(level=1)  # what level 1 keeps of them is nothing yet: still to be filled
        llm.wake_up(tags=["weights"])
        assert not llm.kv_cache_status()["weights_loaded"]
        llm.load_weights(weights.items())
        llm.wake_up()
        assert extkv_tokens(llm, PROMPTS, PARAMS) == first.tokens
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 63)),
            r"load_weights: model\.layers\.0\.mlp\.up_proj\.weight: shape \(128, 63\) does "
            r"not fit \(128, 64\)",
        ),
        (
            ("model.layers.1.self_attn.k_proj.weight", torch.zeros(16, 64)),
            r"load_weights: model\.layers\.1\.self_attn\.k_proj\.weight: shape \(16, 64\) "
            r"does not fit \(64, 64\)",
        ),
        (
            ("model.layers.0.mlp.up.weight", torch.zeros(128, 64)),
            r"load_weights .* does not match Qwen3ForCausalLM: unexpected tensors: "
            r"model\.layers\.0\.mlp\.up\.weight$",
        ),
        (
            ("model.norm.weight", torch.zeros(64, dtype=torch.int64)),
            r"load_weights: model\.norm\.weight has dtype torch\.int64; a floating-point",
        ),
        (
            ("model.norm.weight", torch.zeros(64)),
            r"load_weights: model\.norm\.weight is given twice",
        ),
        (("model.norm.weight",), r"weights must be \(name, tensor\) pairs; got \('model\.norm"),
    ],
    ids=["shape", "merged-part-shape", "name", "dtype", "twice", "not-a-pair"],
)
def test_bad_weights_name_the_parameter_and_load_nothing(
    llm: LLM, first: Model, second: Model, bad: tuple, match: str
) -> None:
    """The second model's weights, then one bad entry (in place of the right one, but for
    the one given twice): none of them is loaded."""
    twice = "given twice" in match
    given = [(n, t) for n, t in checkpoint_weights(second.path).items() if twice or n != bad[0]]
    weights = [*given, bad]
    with pytest.raises(ValueError, match=match):
        llm.load_weights(weights)
    assert extkv_tokens(llm, PROMPTS, PARAMS) == first.tokens


def test_load_weights_refused_while_the_weights_sleep_or_requests_run(
    llm: LLM, first: Model
) -> None:
    weights = checkpoint_weights(first.path)
    llm.sleep(level=1)
    with pytest.raises(EngineAsleepError, match=r"wake_up\(tags=\['weights'\]\) first"):
        llm.load_weights(weights.items())
    llm.wake_up()
    request = llm.engine.add_request(PROMPTS[0], PARAMS)
    llm.engine.step()
    with pytest.raises(EngineStateError, match=r"1 request\(s\) in flight"):
        llm.load_weights(weights.items())
    llm.engine.abort_request(request)
    llm.load_weights(weights.items())  # idle again: the same weights, the same tokens
    assert extkv_tokens(llm, PROMPTS, PARAMS) == first.tokens


def test_load_weights_without_sleep_mode_updates_what_it_is_given(
    first: Model, second: Model
) -> None:
    llm = LLM(first.path, **OPTIONS)
    try:
        layer = "model.layers.1.mlp."  # a subset: one layer's MLP
        ours, theirs = checkpoint_weights(first.path), checkpoint_weights(second.path)
        llm.load_weights((n, t) for n, t in theirs.items() if n.startswith(layer))
        mixed = extkv_tokens(llm, PROMPTS, PARAMS)
        assert mixed != first.tokens and mixed != second.tokens
        llm.load_weights((n, t) for n, t in ours.items() if n.startswith(layer))
        assert extkv_tokens(llm, PROMPTS, PARAMS) == first.tokens
        llm.load_weights(theirs.items())
        assert extkv_tokens(llm, PROMPTS, PARAMS) == second.tokens
    finally:
        llm.close()
