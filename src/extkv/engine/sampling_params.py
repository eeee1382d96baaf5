"""How one request is sampled, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """temperature 0 is greedy; top_k -1 and top_p 1.0 mean no truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (disabled) or an int >= 1, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63) or None, got {self.seed!r}")
        stops = self.stop_token_ids or []
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
