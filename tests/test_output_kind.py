"""vLLM's `output_kind` on the tiny random Qwen3 (CPU, fp32), the engine stepped as a server
steps it: DELTA outputs, joined, are the CUMULATIVE final (tokens, logprobs, prompt
logprobs, text, with and without stop strings, n > 1), each carrying only what its step
added; FINAL_ONLY gives one output per request; `LLM.generate` returns whole outputs
whatever the kind."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from extkv import LLM, RequestOutputKind, SamplingParams
from extkv.demo import make_random_checkpoint
from extkv.engine.llm_engine import LLMEngine
from extkv.engine.outputs import CompletionOutput, RequestOutput
from helpers import SAMPLING_ENGINE as SMALL
from helpers import SAMPLING_PROMPTS as PROMPTS
from helpers import boundary_stop, greedy

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind
EOS = 0  # the random checkpoint's EOS, a special token of its tokenizer


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request: pytest.FixtureRequest, qwen3: Path) -> LLM:
    llm = LLM(qwen3, async_scheduling=request.param, **SMALL)
    yield llm
    llm.close()


def stream(engine: LLMEngine, params: list[SamplingParams]) -> list[list[RequestOutput]]:
    """Each request's outputs, one prompt of PROMPTS per params, stepped as the server
    steps (an output every step, for whoever wants one)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=False)]
    outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return [outputs[i] for i in ids]


def joined(deltas: list[RequestOutput]) -> list[CompletionOutput]:
    """A request's DELTA outputs as one CompletionOutput per completion: tokens, logprobs
    and text in order, the end (finish and stop reason, cumulative logprob) from the last."""
    whole: dict[int, CompletionOutput] = {}
    for output in deltas:
        for c in output.outputs:
            before = whole.get(c.index)
            if before is None:
                whole[c.index] = replace(c, token_ids=list(c.token_ids))
                continue
            whole[c.index] = replace(
                c,
                token_ids=before.token_ids + c.token_ids,
                text=None if c.text is None else before.text + c.text,
                logprobs=None if c.logprobs is None else before.logprobs + c.logprobs,
            )
    return [whole[i] for i in sorted(whole)]


def stop_string(llm: LLM) -> str:
    """A stop string of PROMPTS[0]'s greedy text across two of its tokens: a stream that
    did not hold back would show its first character a step before it is found."""
    [output] = llm.generate(
        prompt_token_ids=PROMPTS[:1], sampling_params=greedy(24), use_tqdm=False
    )
    return boundary_stop(llm.get_tokenizer(), output.outputs[0].token_ids)[1]


def content(output: RequestOutput) -> tuple:
    """What an output says, but its request id (which each run numbers anew)."""
    return (output.prompt_token_ids, output.outputs, output.finished, output.prompt_logprobs)


CASES = {
    "plain": lambda stop: greedy(20),
    "logprobs": lambda stop: greedy(12, logprobs=3, prompt_logprobs=2),
    "stop": lambda stop: greedy(24, stop=[stop, "never \x00"], logprobs=1),
    "stop-kept": lambda stop: greedy(24, stop=stop, include_stop_str_in_output=True),
    "eos": lambda stop: SamplingParams(
        temperature=0, max_tokens=20, min_tokens=3, logit_bias={EOS: 50.0}
    ),
    "n3": lambda stop: SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=16, stop=stop, logprobs=2, prompt_logprobs=1
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_delta_outputs_join_to_the_cumulative_final(llm: LLM, case: str) -> None:
    params = CASES[case](stop_string(llm))
    cumulative = stream(llm.engine, [params] * 3)
    deltas = stream(llm.engine, [replace(params, output_kind=DELTA)] * 3)
    for whole, parts in zip(cumulative, deltas, strict=True):
        final = whole[-1]
        assert final.finished and parts[-1].finished and not any(o.finished for o in parts[:-1])
        assert joined(parts) == final.outputs
        assert all(c.text is not None for o in parts for c in o.outputs)  # streamed as decoded
        # Prompt logprobs once, in the first output; the prompt ids are in every one.
        assert parts[0].prompt_logprobs == final.prompt_logprobs
        assert all(o.prompt_logprobs is None for o in parts[1:])
        assert all(o.prompt_token_ids == final.prompt_token_ids for o in parts)
    ends = [(c.finish_reason, c.stop_reason) for w in cumulative for c in w[-1].outputs]
    if case.startswith("stop"):  # the stop string ended the first
        assert ends[0] == ("stop", params.stop[0])
    if case == "eos":
        assert ends == [("stop", None)] * 3
    if case == "n3":
        assert len({tuple(c.token_ids) for c in cumulative[0][-1].outputs}) == 3


def test_delta_outputs_carry_only_the_new_tokens(llm: LLM) -> None:
    """A step's DELTA output holds the one token it added per completion (and its logprobs),
    so streaming L tokens copies O(L) entries; CUMULATIVE copies 1 + 2 + ... + L."""
    params = SamplingParams(
        n=2, temperature=0.8, seed=1, max_tokens=40, ignore_eos=True, logprobs=4
    )
    [cumulative] = stream(llm.engine, [params])
    [deltas] = stream(llm.engine, [replace(params, output_kind=DELTA)])
    assert len(deltas) == len(cumulative) == 40  # an output per step, one token a step
    for output in deltas:
        assert [c.index for c in output.outputs] == [0, 1]
        assert all(len(c.token_ids) == len(c.logprobs) == 1 for c in output.outputs)
    copied = sum(len(c.token_ids) + len(c.logprobs) for o in cumulative for c in o.outputs)
    assert copied == 2 * 2 * sum(range(1, 41))
    assert sum(len(c.token_ids) + len(c.logprobs) for o in deltas for c in o.outputs) == 2 * 2 * 40
    assert joined(deltas) == cumulative[-1].outputs


def test_delta_leaves_out_the_completions_with_nothing_new(llm: LLM) -> None:
    """n = 3 ending at different lengths (one token in 7 stops): once a completion has
    ended, later outputs hold only the others, and its end is given once."""
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=3,
        max_tokens=30,
        stop_token_ids=list(range(1, 384, 7)),
        output_kind=DELTA,
    )
    [deltas] = stream(llm.engine, [params])
    ends = [c.index for o in deltas for c in o.outputs if c.finish_reason is not None]
    assert sorted(ends) == [0, 1, 2]  # each end once
    for i, output in enumerate(deltas):
        ended_before = {c.index for o in deltas[:i] for c in o.outputs if c.finished()}
        assert ended_before.isdisjoint(c.index for c in output.outputs)
        assert output.outputs  # no empty output
    assert len({len(c.token_ids) for c in joined(deltas)}) > 1, "pick stops that end them apart"


def test_final_only_gives_one_output_per_request(llm: LLM) -> None:
    """Next to a CUMULATIVE and a DELTA request, which get theirs every step, and alone."""
    stop = stop_string(llm)
    kinds = [CUMULATIVE, FINAL_ONLY, DELTA]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=12, stop=stop, logprobs=1),
        greedy(9, prompt_logprobs=1),
        greedy(15),
    ]
    kinded = [replace(p, output_kind=k) for p, k in zip(params, kinds, strict=True)]
    outputs = stream(llm.engine, kinded)
    cumulative = stream(llm.engine, params)
    assert [len(o) for o in outputs] == [len(cumulative[0]), 1, len(cumulative[2])]
    assert content(outputs[1][0]) == content(cumulative[1][-1])  # finished, whole
    assert list(map(content, outputs[0])) == list(map(content, cumulative[0]))  # unchanged
    assert joined(outputs[2]) == cumulative[2][-1].outputs
    # Only FINAL_ONLY requests, none watching its tokens: the step's finished-only path.
    finals = stream(llm.engine, [replace(greedy(n), output_kind=FINAL_ONLY) for n in (9, 5, 7)])
    whole = stream(llm.engine, [greedy(n) for n in (9, 5, 7)])
    assert [list(map(content, o)) for o in finals] == [[content(w[-1])] for w in whole]


@pytest.mark.parametrize("kind", [DELTA, FINAL_ONLY])
def test_generate_returns_whole_outputs_whatever_the_kind(
    llm: LLM, kind: RequestOutputKind
) -> None:
    stop = stop_string(llm)
    params = SamplingParams(
        n=2, temperature=1.0, seed=9, max_tokens=14, stop=stop, logprobs=2, prompt_logprobs=1
    )
    outputs = [
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
        for p in (replace(params, output_kind=kind), params)
    ]
    assert list(map(content, outputs[0])) == list(map(content, outputs[1]))


def test_delta_without_a_tokenizer_streams_token_ids(tmp_path: Path) -> None:
    path = make_random_checkpoint(tmp_path / "bare", with_tokenizer=False)
    llm = LLM(path, **SMALL)
    try:
        params = greedy(10, logprobs=1)
        [cumulative] = stream(llm.engine, [params])
        [deltas] = stream(llm.engine, [replace(params, output_kind=DELTA)])
        assert all(c.text is None for o in deltas for c in o.outputs)
        assert joined(deltas) == cumulative[-1].outputs
        assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * 10
    finally:
        llm.close()
