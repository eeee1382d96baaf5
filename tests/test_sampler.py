"""The sampler's truncations: min-p keeps what transformers' min-p warper keeps, and
sampling never draws a token it dropped."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper

from extkv.engine.sampler import Sampler, _truncate
from extkv.engine.sampling_params import SamplingParams

VOCAB = 50


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9])
def test_min_p_keeps_what_transformers_keeps(min_p: float) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    off = torch.full((4,), -1), torch.ones(4)
    ours = _truncate(logits, *off, torch.full((4,), min_p))
    theirs = MinPLogitsWarper(min_p)(None, logits.clone()) if min_p else logits
    assert torch.equal(ours.isinf(), theirs.isinf())
    kept = ~ours.isinf()
    assert torch.equal(ours[kept], logits[kept])  # what stays is not rescaled
    assert kept[torch.arange(4), logits.argmax(dim=-1)].all()


def test_sampling_with_min_p_draws_only_kept_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(200, 1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    loose = SamplingParams(temperature=1.0)
    strict = SamplingParams(temperature=1.0, min_p=0.35)  # keeps p >= 0.175: tokens 0 and 1
    seen_loose = set(sampler(logits, [loose] * 200, [None] * 200).tolist())
    seen_strict = set(sampler(logits, [strict] * 200, [None] * 200).tolist())
    assert seen_loose == {0, 1, 2, 3}
    assert seen_strict == {0, 1}


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_min_p_outside_0_1_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=bad)
