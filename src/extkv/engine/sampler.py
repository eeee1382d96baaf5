"""Turns logits into tokens: logit bias, min_tokens masks and penalties, then greedy,
temperature, min-p, top-k, top-p; and the logprobs a request asks for.

Sampling draws by the exponential race (argmax of p / Exp(1)), which needs one
noise row per sequence; a seeded request draws its row from its own generator,
so its tokens do not depend on what else is in the batch. Every step works on
the whole batch at once: the rows that need an adjustment or logprobs are
gathered into one tensor each, never looped over on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from extkv.engine.sampling_batch import LogitAdjustments, SamplingBatch


def _truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask logits outside each row's min-p, top-k and nucleus top-p, in vLLM's order
    (min-p on the whole distribution, top-p on what is left; k <= 0, p >= 1, min_p 0: off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    full = sorted_logits.softmax(dim=-1)
    drop = full < min_p[:, None] * full[:, :1]  # column 0 is the most likely token
    drop |= ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before > top_p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def apply_penalties(
    logits: torch.Tensor,
    history: torch.Tensor,
    is_output: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalised logits of rows (R, V) given each row's tokens `history` (R, L), padded
    with V. Repetition (transformers' and vLLM's rule) covers prompt and output tokens;
    presence and frequency (OpenAI's) only the output ones (`is_output`)."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab + 1, device=logits.device)
    counts.scatter_add_(1, history, is_output.to(counts.dtype))
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, history, True)
    counts, seen = counts[:, :vocab], seen[:, :vocab]
    penalty = repetition[:, None]
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, scaled, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def _adjust(logits: torch.Tensor, adjust: LogitAdjustments) -> torch.Tensor:
    """A copy of `logits` with the batch's biases, masks and penalties applied."""
    logits = logits.clone()
    if adjust.bias is not None:
        rows, cols, values = adjust.bias
        logits.index_put_((rows, cols), values, accumulate=True)
    if adjust.banned is not None:
        logits.index_put_(adjust.banned, torch.tensor(float("-inf"), device=logits.device))
    if adjust.penalty_rows is not None:
        rows = adjust.penalty_rows
        logits[rows] = apply_penalties(
            logits[rows],
            adjust.history,
            adjust.is_output,
            adjust.presence,
            adjust.frequency,
            adjust.repetition,
        )
    return logits


@dataclass
class TopLogprobs:
    """Per row: column 0 the chosen token, columns 1..k the k most likely; logprobs and
    1-based ranks among the vocabulary (ties rank as the best of them), as vLLM gives."""

    token_ids: torch.Tensor  # int64 (R, k + 1)
    logprobs: torch.Tensor  # float32 (R, k + 1)
    ranks: torch.Tensor  # int64 (R, k + 1)

    def to_host(self) -> TopLogprobs:
        """A copy on the host, written behind the step (the caller waits for the step)."""
        return TopLogprobs(
            *(t.to("cpu", non_blocking=True) for t in (self.token_ids, self.logprobs, self.ranks))
        )


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> TopLogprobs:
    """The raw log-softmax of `logits` (R, V) at `chosen` (R,) and at the top `k` tokens."""
    chosen = chosen.long()  # the decode graph's tokens are int32
    logprobs = logits.log_softmax(dim=-1)
    top, top_ids = logprobs.topk(k, dim=-1)
    chosen_logprob = logprobs.gather(1, chosen[:, None])
    chosen_rank = (logprobs >= chosen_logprob).sum(dim=-1, keepdim=True)
    top_ranks = torch.arange(1, k + 1, device=logits.device).expand(len(logits), k)
    return TopLogprobs(
        torch.cat([chosen[:, None], top_ids], dim=1),
        torch.cat([chosen_logprob, top], dim=1),
        torch.cat([chosen_rank, top_ranks], dim=1),
    )


@dataclass
class SamplerOutput:
    """One token per row, and the logprobs of the rows of `batch.logprob_rows`."""

    tokens: torch.Tensor  # (num_rows,): int64, or int32 where it is the caller's greedy tokens
    logprobs: TopLogprobs | None


class Sampler:
    """Picks each sequence's next token on the device; greedy rows with nothing to adjust
    take the argmax the caller may already have (the decode graph computes it)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed of their own

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        greedy_tokens: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits: float32 (num_seqs, vocab) -> one token per row, on the device (the host
        reads them later): `greedy_tokens` itself where every row takes it unadjusted."""
        raw = logits
        if batch.adjust is not None:
            logits = _adjust(logits, batch.adjust)
            greedy_tokens = None
        tokens = logits.argmax(dim=-1) if greedy_tokens is None else greedy_tokens
        params = batch.params
        sampled_rows = []  # the rows that draw a token: none in an all-greedy batch
        if not all(p.greedy for p in batch.distinct):
            sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            tokens = tokens.clone()
            rows = torch.tensor(sampled_rows, device=logits.device)
            chosen = [params[i] for i in sampled_rows]
            device = logits.device
            temperature = torch.tensor([p.temperature for p in chosen], device=device)
            vocab = logits.shape[-1]  # a larger top_k truncates nothing, like vLLM's
            top_k = torch.tensor([min(p.top_k, vocab) for p in chosen], device=device)
            top_p = torch.tensor([p.top_p for p in chosen], device=device)
            min_p = torch.tensor([p.min_p for p in chosen], device=device)
            scaled = _truncate(logits[rows] / temperature[:, None], top_k, top_p, min_p)
            probs = scaled.softmax(dim=-1)
            noise = torch.stack(
                [
                    torch.empty_like(probs[0]).exponential_(
                        generator=batch.generators[i] or self.generator
                    )
                    for i in sampled_rows
                ]
            )
            tokens[rows] = (probs / noise).argmax(dim=-1).to(tokens.dtype)
        logprobs = None
        if batch.logprob_rows:
            rows = torch.tensor(batch.logprob_rows, device=logits.device)
            logprobs = top_logprobs(raw[rows], tokens[rows], max(batch.logprob_k))
        return SamplerOutput(tokens, logprobs)
