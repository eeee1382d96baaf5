"""What `generate` returns, shaped like vLLM's outputs (its classes, fields and logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability at one position, its 1-based rank in the vocabulary
    (ties rank as the best of them) and its text, as vLLM gives them."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token and the top k).
SampleLogprobs = list[dict[int, Logprob]]
# The same over the prompt; the first prompt token has nothing before it: None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request (`index` 0 to n - 1); `text` only once finished (in a
    DELTA output: the new text, every output). `stop_reason`: the stop string or stop
    token id that ended it (None for EOS, length or still running); `logprobs` and
    `cumulative_logprob` (the total so far, in a DELTA output too) only when asked for."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        """Whether this completion has ended (vLLM's method of the same name)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's progress as `step` reports it and its result as `generate` returns it:
    one CompletionOutput per completion (SamplingParams.n), in index order (in a DELTA
    output, only those with something new; the prompt logprobs only in the first)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_logprobs: PromptLogprobs | None = None
