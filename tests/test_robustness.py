"""No request can break the engine: bad values are refused up front, a step that fails
ends only its own requests, and `LLM` stays usable after any failed call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from extkv import LLM, SamplingParams
from extkv.engine.errors import EngineDeadError, RequestFailedError
from extkv.engine.model_runner import ModelRunner
from helpers import extkv_tokens

SMALL = dict(cpu_memory_budget_bytes=256 << 20, max_model_len=256, max_num_batched_tokens=512)
PROMPT_A, PROMPT_B = [5, 6, 7, 8, 9], [11, 12, 13]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request: pytest.FixtureRequest, qwen3: Path) -> LLM:
    llm = LLM(qwen3, async_scheduling=request.param, **SMALL)
    yield llm
    llm.close()


def fail_steps_of(monkeypatch: pytest.MonkeyPatch, prompt: list[int], error: Exception) -> None:
    """Make every step that prefills `prompt` raise `error` (a fault in its step)."""
    execute = ModelRunner.execute

    def faulty(self, plan):
        if any(r.num_computed_tokens == 0 and r.token_ids == prompt for r in plan.requests):
            raise error
        return execute(self, plan)

    monkeypatch.setattr(ModelRunner, "execute", faulty)


def test_values_no_tensor_can_hold_are_refused_and_a_huge_top_k_truncates_nothing(
    llm: LLM,
) -> None:
    for bad in ({"top_k": 2**63}, {"temperature": 1e39}, {"max_tokens": 2**63}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    seeded = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    huge = extkv_tokens(llm, [PROMPT_A], SamplingParams(top_k=2**63 - 1, **seeded))
    assert huge == extkv_tokens(llm, [PROMPT_A], SamplingParams(top_k=-1, **seeded))


def test_tiny_temperatures_are_greedy(llm: LLM) -> None:
    greedy = extkv_tokens(llm, [PROMPT_A], GREEDY)
    for temperature in (1e-40, 1e-6):
        params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True)
        assert extkv_tokens(llm, [PROMPT_A], params) == greedy


def test_a_failing_step_fails_only_its_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = extkv_tokens(llm, [PROMPT_A], GREEDY)[0]
    engine = llm.engine
    fail_steps_of(monkeypatch, PROMPT_B, RuntimeError("boom"))
    a = engine.add_request(PROMPT_A, GREEDY)
    engine.step()  # A's prefill, on its own
    b = engine.add_request(PROMPT_B, GREEDY)  # its prefill step fails
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step(finished_only=True)}
    assert finished[b].error == "RuntimeError: boom"
    assert finished[b].outputs[0].finish_reason == "error" and finished[b].finished
    assert finished[a].error is None and finished[a].outputs[0].token_ids == expected
    assert engine.block_manager.num_used_blocks == 0


def test_generate_raises_the_failure_and_stays_usable(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = extkv_tokens(llm, [PROMPT_A, PROMPT_B], GREEDY)
    with monkeypatch.context() as patch:
        fail_steps_of(patch, PROMPT_B, RuntimeError("boom"))
        with pytest.raises(RequestFailedError, match="failed: RuntimeError: boom"):
            extkv_tokens(llm, [PROMPT_A, PROMPT_B], GREEDY)
    assert not llm.engine.scheduler.has_unfinished()  # nothing left queued
    assert llm.engine.block_manager.num_used_blocks == 0
    assert extkv_tokens(llm, [PROMPT_A, PROMPT_B], GREEDY) == expected


def test_an_interrupted_generate_leaves_nothing_queued(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = extkv_tokens(llm, [PROMPT_A], GREEDY)
    with monkeypatch.context() as patch:
        fail_steps_of(patch, PROMPT_A, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            extkv_tokens(llm, [PROMPT_A, PROMPT_B], GREEDY)
    assert extkv_tokens(llm, [PROMPT_A], GREEDY) == expected


def test_a_device_error_kills_the_engine_for_good(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(qwen3, **SMALL)
    fail_steps_of(monkeypatch, PROMPT_B, torch.AcceleratorError("CUDA error: illegal address"))
    with pytest.raises(EngineDeadError, match="illegal address"):
        extkv_tokens(llm, [PROMPT_B], GREEDY)
    with pytest.raises(EngineDeadError):
        extkv_tokens(llm, [PROMPT_A], GREEDY)
    llm.close()


def test_generate_after_close_says_so(qwen3: Path) -> None:
    llm = LLM(qwen3, **SMALL)
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        extkv_tokens(llm, [PROMPT_A], GREEDY)
