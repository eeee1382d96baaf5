"""How one request is sampled, in the shape vLLM users know (its field names and meanings)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from extkv.options import (
    INT64_MAX,
    Bool,
    Choice,
    Custom,
    Float,
    Int,
    Texts,
    check_options,
    option,
)

FLOAT32_MAX = 3.4028234663852886e38
# Below this temperature sampling is greedy (vLLM's rule): dividing logits by a tinier
# one overflows float32 and would sample from NaNs.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top-k logprobs per position at most (vLLM's default max_logprobs)


def _token_ids(value: object) -> list[int]:
    ids = [] if value is None else value
    if not isinstance(ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in ids
    ):
        raise ValueError(f"stop_token_ids must be a list of ints in [0, 2**63); got {value!r}")
    return list(ids)


def _logit_bias(value: object) -> dict[int, float] | None:
    """vLLM's logit_bias: token id -> a finite number added to that token's logit."""
    if value is None:
        return None
    ok = isinstance(value, dict) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in value
    )
    ok = ok and all(
        isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b)
        for b in value.values()
    )
    if not ok:
        raise ValueError(
            "logit_bias must be a dict of token ids (ints >= 0) to finite numbers; "
            f"got {value!r:.80}"
        )
    return {t: float(b) for t, b in value.items()}


class RequestOutputKind(enum.Enum):
    """vLLM's: what each RequestOutput of a request carries. CUMULATIVE: everything so far,
    every step; DELTA: only what is new since the request's previous output, so that a
    streamed output costs what the step added, not the whole answer again; FINAL_ONLY: one
    output, once the request has ended."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StopStrings(Texts):
    """vLLM's `stop`: one string or a list of them (None: none); always a list once checked."""

    def describe(self) -> str:
        """The allowed values in words, for `--help` and errors."""
        return "a non-empty string or a list of them"

    def check(self, name: str, value: object) -> object:
        """A list of the strings (a lone string becomes a list of one)."""
        if value is None:
            return []
        return list(super().check(name, [value] if isinstance(value, str) else value))


@dataclass
class SamplingParams:
    """temperature 0 (or below 1e-5) is greedy; top_k -1 or 0, top_p 1.0 and min_p 0 mean
    no truncation, as does a top_k beyond the vocabulary. Penalties, `logit_bias` and
    `min_tokens` apply before the temperature, greedy rows included; logprobs are of the
    model's raw distribution (before them), as vLLM's default."""

    n: int = option(1, "completions per prompt", Int(1, 1024), cli=False)
    temperature: float = option(
        1.0, "softmax temperature; below 1e-5: greedy", Float(0, FLOAT32_MAX)
    )
    top_p: float = option(1.0, "nucleus sampling; 1: off", Float(0, 1, above_minimum=True))
    top_k: int = option(-1, "sample among the k most likely tokens; -1 or 0: off", Int(-1))
    min_p: float = option(
        0.0, "drop tokens less likely than min_p times the most likely one; 0: off", Float(0, 1)
    )
    presence_penalty: float = option(
        0.0, "subtracted from the logit of every token already generated; 0: off", Float(-2, 2)
    )
    frequency_penalty: float = option(
        0.0, "subtracted once per time a token was generated; 0: off", Float(-2, 2)
    )
    repetition_penalty: float = option(
        1.0,
        "divides positive (multiplies negative) logits of tokens in the prompt or output; 1: off",
        Float(0, FLOAT32_MAX, above_minimum=True),
    )
    logit_bias: dict[int, float] | None = option(
        None,
        "token id -> number added to its logit",
        Custom(_logit_bias, "a dict of token ids to numbers"),
        cli=False,
    )
    max_tokens: int = option(16, "tokens to generate", Int(1))
    min_tokens: int = option(
        0, "tokens to generate before EOS or a stop token may end the output", Int(0)
    )
    seed: int | None = option(
        None, "seed of this request's sampling", Int(0, optional=True), flag="--sampling-seed"
    )
    stop: list[str] | None = option(
        None, "a string that ends the output (repeatable)", StopStrings()
    )
    stop_token_ids: list[int] | None = option(
        None, "token ids that end the output", Custom(_token_ids, "ints >= 0"), cli=False
    )
    include_stop_str_in_output: bool = option(
        False, "keep the stop string (or stop token's text) at the end of the text", Bool()
    )
    ignore_eos: bool = option(False, "generate past the end-of-sequence token", Bool())
    skip_special_tokens: bool = option(True, "leave special tokens out of the text", Bool())
    logprobs: int | None = option(
        None,
        "log-probabilities of the top k tokens at each generated position (and of the sampled one)",
        Int(0, MAX_LOGPROBS, optional=True),
        cli=False,
    )
    prompt_logprobs: int | None = option(
        None,
        "log-probabilities of the top k tokens at each prompt position (and of the prompt's)",
        Int(0, MAX_LOGPROBS, optional=True),
        cli=False,
    )
    output_kind: RequestOutputKind = option(
        RequestOutputKind.CUMULATIVE,
        "what each output of the request carries: all so far, what is new, or only the final",
        Choice(tuple(RequestOutputKind)),
        cli=False,
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}); got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """Whether to take the argmax: temperatures this low would overflow float32 logits."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the sequence's tokens (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def needs_context(self) -> bool:
        """Whether a decode step's sampling needs more of the request than its token: its
        tokens (penalties) or its length (`min_tokens` bans the ending tokens until then)."""
        return self.min_tokens > 0 or self.has_penalties
