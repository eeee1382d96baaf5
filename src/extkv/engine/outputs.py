"""What `generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request (index 0: one per request); `text` only once finished."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running


@dataclass
class RequestOutput:
    """A request's progress as `step` reports it and its result as `generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # why the request failed (finish_reason "error")
