"""SamplingParams takes vLLM's fields and refuses bad values by name, saying what is allowed;
the outputs have vLLM's shape."""

from __future__ import annotations

import pytest

import extkv
from extkv.engine import outputs
from extkv.engine.sampling_params import RequestOutputKind, SamplingParams

OUTPUT_KINDS = (
    "output_kind must be one of RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, "
    "RequestOutputKind.FINAL_ONLY; got "
)


@pytest.mark.parametrize(
    ("bad", "allowed"),
    [
        ({"n": 0}, r"n must be an int in \[1, 1024\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be a number in \(0, "),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a number"),
        ({"min_tokens": -1}, r"min_tokens must be an int in \[0, 2\*\*63\)"),
        ({"min_tokens": 20, "max_tokens": 10}, r"min_tokens must be at most max_tokens \(10\)"),
        ({"logprobs": 21}, r"logprobs must be an int in \[0, 20\] or None"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be an int in \[0, 20\] or None"),
        ({"stop": ""}, "stop must be a non-empty string or a list of them"),
        ({"stop": ["a", 3]}, "stop must be a non-empty string or a list of them"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be a list of ints in \[0, 2\*\*63\)"),
        ({"logit_bias": {"5": 1.0}}, r"logit_bias must be a dict of token ids \(ints >= 0\)"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias must be a dict .* to finite numbers"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be True or False"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be True or False"),
        ({"output_kind": 1}, OUTPUT_KINDS + "1"),  # vLLM's is an Enum, not an IntEnum
        ({"output_kind": "DELTA"}, OUTPUT_KINDS + "'DELTA'"),
        ({"output_kind": None}, OUTPUT_KINDS + "None"),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_what_it_allows(
    bad: dict, allowed: str
) -> None:
    with pytest.raises(ValueError, match=allowed):
        SamplingParams(**bad)


def test_values_are_normalised() -> None:
    params = SamplingParams(stop="###", logit_bias={3: 1}, presence_penalty=1)
    assert params.stop == ["###"]
    assert params.logit_bias == {3: 1.0} and isinstance(params.logit_bias[3], float)
    assert isinstance(params.presence_penalty, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


def test_penalties_are_on_only_when_they_change_something() -> None:
    assert not SamplingParams().has_penalties
    assert not SamplingParams(logit_bias={1: 2.0}, logprobs=3).has_penalties
    for on in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}):
        assert SamplingParams(**on).has_penalties


def test_logprob_is_exported_where_vllm_users_look() -> None:
    assert extkv.Logprob is outputs.Logprob
    entry = extkv.Logprob(-0.5, rank=1, decoded_token="a")
    assert (entry.logprob, entry.rank, entry.decoded_token) == (-0.5, 1, "a")
    completion = outputs.CompletionOutput(0, [1], "a", "stop")
    assert completion.logprobs is None and completion.stop_reason is None
    assert completion.finished()
    assert outputs.RequestOutput("r", None, [1]).prompt_logprobs is None


def test_request_output_kind_is_vllms_and_exported_where_vllm_users_look() -> None:
    assert extkv.RequestOutputKind is RequestOutputKind
    assert [(k.name, k.value) for k in RequestOutputKind] == [
        ("CUMULATIVE", 0),
        ("DELTA", 1),
        ("FINAL_ONLY", 2),
    ]
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert (
        SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA
    )


def test_needs_context_is_penalties_or_min_tokens() -> None:
    """A decode samples from its token alone unless penalties (its tokens) or min_tokens
    (its length) apply; logprobs and a bias need neither."""
    assert not SamplingParams(logprobs=2, logit_bias={1: 1.0}).needs_context
    assert SamplingParams(min_tokens=1, max_tokens=4).needs_context
    assert SamplingParams(presence_penalty=0.5).needs_context
    assert SamplingParams(repetition_penalty=1.1).needs_context
