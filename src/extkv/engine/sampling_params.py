"""How one request is sampled, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass

from extkv.options import INT64_MAX, Bool, Custom, Float, Int, check_options, option

FLOAT32_MAX = 3.4028234663852886e38
# Below this temperature sampling is greedy (vLLM's rule): dividing logits by a tinier
# one overflows float32 and would sample from NaNs.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _token_ids(value: object) -> list[int]:
    ids = [] if value is None else value
    if not isinstance(ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in ids
    ):
        raise ValueError(f"stop_token_ids must be a list of ints in [0, 2**63); got {value!r}")
    return list(ids)


@dataclass
class SamplingParams:
    """temperature 0 (or below 1e-5) is greedy; top_k -1 or 0, top_p 1.0 and min_p 0 mean
    no truncation, as does a top_k beyond the vocabulary."""

    temperature: float = option(
        1.0, "softmax temperature; below 1e-5: greedy", Float(0, FLOAT32_MAX)
    )
    top_p: float = option(1.0, "nucleus sampling; 1: off", Float(0, 1, above_minimum=True))
    top_k: int = option(-1, "sample among the k most likely tokens; -1 or 0: off", Int(-1))
    min_p: float = option(
        0.0, "drop tokens less likely than min_p times the most likely one; 0: off", Float(0, 1)
    )
    max_tokens: int = option(16, "tokens to generate", Int(1))
    seed: int | None = option(
        None, "seed of this request's sampling", Int(0, optional=True), flag="--sampling-seed"
    )
    stop_token_ids: list[int] | None = option(
        None, "token ids that end the output", Custom(_token_ids, "ints >= 0"), cli=False
    )
    ignore_eos: bool = option(False, "generate past the end-of-sequence token", Bool())

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def greedy(self) -> bool:
        """Whether to take the argmax: temperatures this low would overflow float32 logits."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE
