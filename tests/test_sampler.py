"""The sampler on its own: min-p keeps what transformers' min-p warper keeps and sampling
never draws a token it dropped; logprobs are the log-softmax with vLLM's ranks; repetition
penalty equals transformers' processor, presence and frequency the OpenAI formula; a plain
batch keeps the decode graph's argmax."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from extkv.engine.sampler import Sampler, _truncate, apply_penalties, top_logprobs
from extkv.engine.sampling_batch import SamplingBatch
from extkv.engine.sampling_params import SamplingParams
from extkv.engine.step_plan import ScheduledRequest

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
    seen_loose = set(sampler(logits, SamplingBatch([loose] * 200, [None] * 200)).tokens.tolist())
    seen_strict = set(sampler(logits, SamplingBatch([strict] * 200, [None] * 200)).tokens.tolist())
    assert seen_loose == {0, 1, 2, 3}
    assert seen_strict == {0, 1}


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_min_p_outside_0_1_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=bad)


def test_top_logprobs_are_the_log_softmax_with_ranks() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    chosen = torch.tensor([0, 7, int(logits[2].argmax())])
    top = top_logprobs(logits, chosen, 4)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.equal(top.token_ids[:, 0], chosen)
    for row in range(3):
        best = ref[row].topk(4)
        assert top.token_ids[row, 1:].tolist() == best.indices.tolist()
        assert top.ranks[row, 1:].tolist() == [1, 2, 3, 4]
        torch.testing.assert_close(top.logprobs[row, 1:].double(), best.values, atol=1e-5, rtol=0)
        expected = ref[row, chosen[row]]
        assert top.logprobs[row, 0].item() == pytest.approx(expected.item(), abs=1e-5)
        assert top.ranks[row, 0].item() == int((ref[row] >= expected).sum())
    assert top.ranks[2, 0].item() == 1


def history_of(rows: list[list[int]]) -> torch.Tensor:
    """Token histories padded with VOCAB, as SamplingBatch builds them."""
    width = max(map(len, rows))
    return torch.tensor([r + [VOCAB] * (width - len(r)) for r in rows])


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty: float) -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    rows = [[3, 5, 5, 9, 40], [1, 2]]
    history = history_of(rows)
    ours = apply_penalties(
        logits,
        history,
        torch.zeros_like(history, dtype=torch.bool),
        torch.zeros(2),
        torch.zeros(2),
        torch.full((2,), penalty),
    )
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i, row in enumerate(rows):
        theirs = processor(torch.tensor([row]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], theirs, atol=0, rtol=0)


def test_presence_and_frequency_penalties_count_only_output_tokens() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    history = torch.tensor([[4, 4, 6, 4, 8, 8]])
    is_output = torch.tensor([[False, True, True, True, True, True]])  # a prompt of one
    ours = apply_penalties(
        logits, history, is_output, torch.tensor([0.5]), torch.tensor([0.25]), torch.ones(1)
    )
    expected = logits.clone()[0]
    for token, count in {4: 2, 6: 1, 8: 2}.items():
        expected[token] -= 0.5 + 0.25 * count
    torch.testing.assert_close(ours[0], expected)


def scheduled_request(request_id: str, tokens: list[int], params: SamplingParams):
    """A prefill of `tokens` that samples with `params`."""
    return ScheduledRequest(
        request_id, 0, len(tokens), tokens, False, 0, params, num_prompt_tokens=len(tokens)
    )


def test_a_plain_batch_takes_the_decode_graphs_argmax() -> None:
    """Nothing to adjust and no logprobs: the tokens are the argmax the caller already has
    (the decode graph's), untouched; with a bias the argmax is taken again."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    greedy = logits.argmax(dim=-1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    plain = SamplingParams(temperature=0)
    out = sampler(logits, SamplingBatch([plain, plain], [None, None]), greedy)
    assert out.tokens is greedy and out.logprobs is None
    request = scheduled_request("a", [1, 2], SamplingParams(temperature=0, logit_bias={9: 99.0}))
    batch = SamplingBatch.build(
        [request, scheduled_request("b", [3], plain)],
        lambda request: None,
        VOCAB,
        torch.zeros(2, dtype=torch.int32),
        {},
    )
    biased = sampler(logits, batch, greedy).tokens
    assert biased.tolist() == [9, greedy[1].item()]
