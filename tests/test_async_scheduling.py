"""Asynchronous scheduling: the next step is launched before the host reads the tokens
of the one in flight. Outputs must equal the synchronous engine's in every situation
that changes the schedule: stop tokens, lengths, preemption, chunked prefill, prefix
caching, hybrid and pure Mamba state, seeded sampling, aborts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from extkv import LLM, SamplingParams
from extkv.cli import add_engine_args

SMALL = dict(cpu_memory_budget_bytes=256 << 20, max_model_len=256, max_num_batched_tokens=512)
PROMPTS = [list(range(10 + 3 * i, 40 + 5 * i)) for i in range(6)] + [[7, 8], [250]]


def run(llm: LLM, prompts: list[list[int]], params) -> list[tuple[list[int], str]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


def mixed_params(
    path: Path, prompts: list[list[int]], longest: int = 12, **options
) -> list[SamplingParams]:
    """Per prompt: stop on a token the free run makes a few tokens in (a stop finish
    the async engine learns of a step late), or stop by a length of its own (up to
    `longest`)."""
    free = run(LLM(path, async_scheduling=False, **options), prompts, NO_EOS)
    params = []
    for i, (tokens, _) in enumerate(free):
        if i % 2:
            length = 5 + (longest - 5) * i // (len(prompts) - 1)
            params.append(SamplingParams(temperature=0, max_tokens=length, ignore_eos=True))
        else:
            params.append(
                SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[3 + i % 5]])
            )
    return params


NO_EOS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SCENARIOS = {
    "roomy": {},
    "preemption": {"num_gpu_blocks_override": 16},
    "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "prefix-caching": {"enable_prefix_caching": True, "num_gpu_blocks_override": 24},
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_async_equals_sync(qwen3: Path, scenario: str) -> None:
    options = {**SMALL, **SCENARIOS[scenario]}
    prompts = [*PROMPTS, [*PROMPTS[0][:20], 99, 98]]  # shares a prefix with the first
    params = mixed_params(qwen3, prompts, **options)
    sync = LLM(qwen3, async_scheduling=False, **options)
    expected = run(sync, prompts, params)
    assert {reason for _, reason in expected} == {"stop", "length"}
    llm = LLM(qwen3, async_scheduling=True, **options)
    assert run(llm, prompts, params) == expected
    assert llm.engine.block_manager.num_used_blocks == 0 or options.get("enable_prefix_caching")
    if scenario == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", ["bamba", "mamba2"])
def test_async_equals_sync_with_mamba_state(family: str, request) -> None:
    """Room for two sequences: the hybrid preempts (the longer prompts outgrow their
    first attention block), pure Mamba queues (one state block per sequence)."""
    path = request.getfixturevalue(family)
    options = dict(cpu_memory_budget_bytes=64 << 20, max_model_len=96, max_num_seqs=4)
    prompts = [[(7 * t + i) % 128 for t in range(20 + 6 * i)] for i in range(8)]
    params = mixed_params(path, prompts, longest=24, **options)
    sync = LLM(path, async_scheduling=False, **options)
    expected = run(sync, prompts, params)
    two = 2 * sync.engine.runner.kv_plan.blocks_per_seq(1)
    tight = LLM(path, async_scheduling=True, num_gpu_blocks_override=two, **options)
    assert run(tight, prompts, params) == expected
    assert (tight.engine.scheduler.num_preemptions > 0) == (family == "bamba")
    assert tight.engine.block_manager.num_used_blocks == 0


def test_outputs_come_one_step_later_and_no_step_is_wasted_on_lengths(qwen3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engines = {mode: LLM(qwen3, async_scheduling=mode, **SMALL).engine for mode in (False, True)}
    tokens = {}
    for mode, engine in engines.items():
        engine.add_request(PROMPTS[0], params)
        first = engine.step()
        # Sync reads the prefill's token at once; async launches it and reads it next step.
        assert [len(o.outputs[0].token_ids) for o in first] == ([] if mode else [1])
        outputs = first
        while engine.has_unfinished_requests():
            outputs += engine.step()
        tokens[mode] = outputs[-1].outputs[0].token_ids
        assert outputs[-1].finished and len(tokens[mode]) == 6
        assert engine.runner.num_steps == 6  # 1 prefill + 5 decodes: none past max_tokens
    assert tokens[True] == tokens[False]


def test_a_token_in_flight_does_not_preempt(qwen3: Path) -> None:
    """Under memory pressure a sequence whose stop token is in flight would take a block
    (and preempt a live sequence) for its wasted step; it waits a step instead."""
    options = {**SMALL, "max_model_len": 128, "num_gpu_blocks_override": 12}
    prompts = PROMPTS[:6]
    free = run(LLM(qwen3, async_scheduling=False, **options), prompts, NO_EOS)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[t[15 - i]])
        for i, (t, _) in enumerate(free)
    ]
    engines = {mode: LLM(qwen3, async_scheduling=mode, **options) for mode in (False, True)}
    outputs = {mode: run(llm, prompts, params) for mode, llm in engines.items()}
    assert outputs[True] == outputs[False]
    preemptions = {mode: llm.engine.scheduler.num_preemptions for mode, llm in engines.items()}
    assert preemptions[True] <= preemptions[False]


def test_seeded_sampling_is_the_same_async(qwen3: Path) -> None:
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    sync = run(LLM(qwen3, async_scheduling=False, **SMALL), PROMPTS, params)
    assert run(LLM(qwen3, async_scheduling=True, **SMALL), PROMPTS, params) == sync


def test_abort_while_a_step_is_in_flight(qwen3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = LLM(qwen3, async_scheduling=True, **SMALL).engine
    kept, dropped = (engine.add_request(p, params) for p in PROMPTS[:2])
    engine.step()
    engine.step()  # the first decode is in flight, the prefill's tokens read
    engine.abort_request(dropped)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {kept}
    assert engine.block_manager.num_used_blocks == 0
    alone = run(LLM(qwen3, async_scheduling=False, **SMALL), PROMPTS[:1], params)
    assert outputs[-1].outputs[0].token_ids == alone[0][0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"async_scheduling": "yes"}, "async_scheduling must be True, False or None"),
        ({"async_scheduling": True, "tensor_parallel_size": 2}, "needs tensor_parallel_size=1"),
    ],
)
def test_bad_async_scheduling(qwen3: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(qwen3, **SMALL, **kwargs)


def test_async_scheduling_flag(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model=None)  # no --model needed here
    assert parser.parse_args([]).async_scheduling is None
    assert parser.parse_args(["--async-scheduling", "false"]).async_scheduling is False
    assert parser.parse_args(["--async-scheduling", "On"]).async_scheduling is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--async-scheduling", "maybe"])
    assert "--async-scheduling must be True, False or None; got 'maybe'" in capsys.readouterr().err


def test_a_default_for_no_option_is_refused() -> None:
    """A command's default for an option that does not exist (a misspelling, an old
    name) fails at once instead of leaving the declared default in place."""
    with pytest.raises(ValueError, match=r"does not have: \['with_model'\]"):
        add_engine_args(argparse.ArgumentParser(), with_model=False)
