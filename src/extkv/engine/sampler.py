"""Turns logits into tokens: greedy, temperature, top-k, top-p.

Sampling draws by the exponential race (argmax of p / Exp(1)), which needs one
noise row per sequence; a seeded request draws its row from its own generator,
so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from extkv.engine.sampling_params import SamplingParams


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


class Sampler:
    """Picks each sequence's next token on the device; greedy rows skip the sampling work."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed of their own

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        greedy_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits: float32 (num_seqs, vocab) -> one int64 token per row, on the device
        (the host reads them later). `greedy_tokens`, the argmax when the caller already
        has it (the decode graph computes it)."""
        tokens = logits.argmax(dim=-1) if greedy_tokens is None else greedy_tokens
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
                        generator=generators[i] or self.generator
                    )
                    for i in sampled_rows
                ]
            )
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens
