"""One step's sampling inputs on the device, built from the step's sampled requests:
each request's parameters and generator, and, only for the rows that need them, the
padded tensors of logit biases, min_tokens masks, penalty histories and logprobs."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from extkv.engine.sampling_params import SamplingParams
from extkv.engine.step_plan import ScheduledRequest


@dataclass
class LogitAdjustments:
    """What changes the logits before sampling; None: that part is off for the whole batch.
    `bias` and `banned` index the batch's rows; the penalty tensors are of `penalty_rows`."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids set to -inf
    penalty_rows: torch.Tensor | None = None
    history: torch.Tensor | None = None  # (P, L) tokens, padded with the vocabulary size
    is_output: torch.Tensor | None = None  # (P, L) bool: a generated token, not the prompt's
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None


@dataclass
class SamplingBatch:
    """The sampler's view of a step: one entry per sampled row."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    adjust: LogitAdjustments | None = None
    logprob_rows: list[int] = field(default_factory=list)  # rows whose logprobs are returned
    logprob_k: list[int] = field(default_factory=list)  # top-k of each of those rows
    # The distinct objects among `params` (see distinct_params): what a question asked of
    # every row asks, found once per step.
    distinct: Collection[SamplingParams] = field(init=False)

    def __post_init__(self) -> None:
        self.distinct = distinct_params(self.params)

    @classmethod
    def build(
        cls,
        requests: list[ScheduledRequest],
        generator_of: Callable[[ScheduledRequest], torch.Generator | None],
        vocab_size: int,
        last_tokens: torch.Tensor,
        last_rows: dict[str, int],
    ) -> SamplingBatch:
        """The batch of `requests` (each has `sampling`), a seeded one's generator from
        `generator_of` (a step without a seeded request, the usual one, asks none); a
        pending last token is read from `last_tokens` (row `last_rows[request_id]`: the
        previous step's samples)."""
        params = [r.sampling for r in requests]
        batch = cls(params, [None] * len(params))
        if any(p.seed is not None for p in batch.distinct):
            batch.generators = [generator_of(r) for r in requests]
        if not any(map(_adjusts, batch.distinct)):
            return batch  # the usual batch: nothing to adjust, no logprobs
        batch.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        batch.logprob_k = [params[i].logprobs for i in batch.logprob_rows]
        device = last_tokens.device
        adjust = LogitAdjustments()
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
        if biased:
            rows = [i for i, bias in biased for _ in bias]
            ids = [t for _, bias in biased for t in bias]
            values = [b for _, bias in biased for b in bias.values()]
            adjust.bias = (
                torch.tensor(rows, device=device),
                torch.tensor(ids, device=device),
                torch.tensor(values, device=device),
            )
        banned = [  # a list only for the rows that ban any (min_tokens): few, if any
            (i, [t for t in r.banned_token_ids if t < vocab_size])
            for i, r in enumerate(requests)
            if r.banned_token_ids
        ]
        banned = [(i, ids) for i, ids in banned if ids]
        if banned:
            adjust.banned = (
                torch.tensor([i for i, ids in banned for _ in ids], device=device),
                torch.tensor([t for _, ids in banned for t in ids], device=device),
            )
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            _add_penalties(
                adjust, [requests[i] for i in penalised], vocab_size, last_tokens, last_rows
            )
            adjust.penalty_rows = torch.tensor(penalised, device=device)
        if biased or banned or penalised:
            batch.adjust = adjust
        return batch


def distinct_params(params: list[SamplingParams]) -> Collection[SamplingParams]:
    """The distinct objects among `params`, found in C: a step's requests share a few (one
    `generate` call's share one), so a question asked of every row is asked of these."""
    return dict(zip(map(id, params), params, strict=True)).values()


def _adjusts(params: SamplingParams) -> bool:
    """Whether rows of `params` change their logits (bias, banned tokens before min_tokens,
    penalties) or return logprobs."""
    return params.logprobs is not None or bool(params.logit_bias) or params.needs_context


def _add_penalties(
    adjust: LogitAdjustments,
    requests: list[ScheduledRequest],
    vocab_size: int,
    last_tokens: torch.Tensor,
    last_rows: dict[str, int],
) -> None:
    """One padded (P, L) history of the penalised rows: the tokens the host knows, then
    the pending one copied on the device from the previous step's samples."""
    device = last_tokens.device
    lengths = [len(r.history) + r.pending for r in requests]
    host = np.full((len(requests), max(lengths)), vocab_size, dtype=np.int64)
    for row, r in enumerate(requests):
        host[row, : len(r.history)] = r.history
    history = torch.from_numpy(host).to(device)
    pending = [row for row, r in enumerate(requests) if r.pending]
    if pending:
        sources = [last_rows[requests[row].request_id] for row in pending]
        columns = [len(requests[row].history) for row in pending]
        history[pending, columns] = last_tokens[sources].long()
    prompt = torch.tensor([r.num_prompt_tokens for r in requests], device=device)
    adjust.history = history
    adjust.is_output = torch.arange(history.shape[1], device=device)[None, :] >= prompt[:, None]
    adjust.presence = torch.tensor([r.sampling.presence_penalty for r in requests], device=device)
    adjust.frequency = torch.tensor([r.sampling.frequency_penalty for r in requests], device=device)
    adjust.repetition = torch.tensor(
        [r.sampling.repetition_penalty for r in requests], device=device
    )
