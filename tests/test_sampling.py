"""vLLM's sampling features end to end on the tiny random Qwen3 (CPU, fp32), each checked
against transformers or against what it must do: logprobs and prompt logprobs equal
transformers' log-softmax, penalties give transformers' (or the formula's) greedy tokens,
logit_bias, min_tokens, stop strings across token boundaries, stop tokens, n completions,
skip_special_tokens; greedy and seeded results do not depend on the batch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from extkv import LLM, SamplingParams
from extkv.engine.outputs import RequestOutput
from helpers import SAMPLING_ENGINE as SMALL
from helpers import SAMPLING_PROMPTS as PROMPTS
from helpers import boundary_stop, greedy

EOS = 0  # the random checkpoint's EOS, a special token of its tokenizer
ATOL = 1e-4


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request: pytest.FixtureRequest, qwen3: Path) -> LLM:
    llm = LLM(qwen3, async_scheduling=request.param, **SMALL)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf(qwen3: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()


def run(llm: LLM, prompts: list[list[int]], params) -> list[RequestOutput]:
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


@torch.no_grad()
def hf_logprobs(hf: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `tokens`."""
    return hf(torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def test_logprobs_and_prompt_logprobs_match_transformers(llm: LLM, hf) -> None:
    tokenizer = llm.get_tokenizer()
    params = greedy(8, logprobs=5, prompt_logprobs=3)
    for prompt, out in zip(PROMPTS[:2], run(llm, PROMPTS[:2], params), strict=True):
        completion = out.outputs[0]
        ref = hf_logprobs(hf, prompt + completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        total = 0.0
        for i, (token, entry) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = ref[len(prompt) - 1 + i]
            top = row.topk(5)
            assert next(iter(entry)) == token  # the sampled token comes first
            assert set(entry) == {token, *top.indices.tolist()}
            assert entry[token].rank == 1  # greedy
            for rank, (lp, t) in enumerate(
                zip(top.values.tolist(), top.indices.tolist(), strict=True), 1
            ):
                assert entry[t].logprob == pytest.approx(lp, abs=ATOL)
                assert entry[t].rank == rank
                assert entry[t].decoded_token == tokenizer.decode([t])
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=ATOL)
        prompt_logprobs = out.prompt_logprobs
        assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            row, entry = ref[j - 1], prompt_logprobs[j]
            assert next(iter(entry)) == prompt[j]
            assert set(entry) >= set(row.topk(3).indices.tolist())
            assert len(entry) in (3, 4)
            for t, logprob in entry.items():
                assert logprob.logprob == pytest.approx(row[t].item(), abs=ATOL)
            rank = int((row >= row[prompt[j]]).sum())
            assert entry[prompt[j]].rank == rank


def test_sampled_logprobs_rank_the_sampled_token(llm: LLM, hf) -> None:
    params = SamplingParams(temperature=1.5, seed=4, max_tokens=10, ignore_eos=True, logprobs=0)
    completion = run(llm, PROMPTS[:1], params)[0].outputs[0]
    ref = hf_logprobs(hf, PROMPTS[0] + completion.token_ids)
    assert completion.cumulative_logprob is not None
    ranks = []
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(PROMPTS[0]) - 1 + i]
        assert list(entry) == [token]  # k = 0: only the sampled token
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=ATOL)
        ranks.append(entry[token].rank)
        assert entry[token].rank == int((row >= row[token]).sum())
    assert max(ranks) > 1  # at temperature 1.5 not every token is the argmax


def test_no_logprobs_unless_asked(llm: LLM) -> None:
    out = run(llm, PROMPTS[:1], greedy(4))[0]
    assert out.prompt_logprobs is None
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_prompt_logprobs_survive_chunks_and_the_prefix_cache(qwen3: Path, llm: LLM) -> None:
    params = greedy(2, prompt_logprobs=2)
    whole = run(llm, PROMPTS[1:2], params)[0].prompt_logprobs
    chunked = LLM(qwen3, **{**SMALL, "max_num_batched_tokens": 16}, enable_prefix_caching=True)
    try:
        for _ in range(2):  # the second run's prompt is in the prefix cache
            again = run(chunked, PROMPTS[1:2], params)[0].prompt_logprobs
            assert again[0] is None and len(again) == len(whole)
            for a, b in zip(again[1:], whole[1:], strict=True):
                assert a.keys() == b.keys()
                assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=ATOL) for t in a)
    finally:
        chunked.close()


def hf_penalised_greedy(hf, prompt: list[int], steps: int, presence: float, frequency: float):
    """Greedy decoding with OpenAI's presence and frequency penalties on the output tokens."""
    tokens = list(prompt)
    for _ in range(steps):
        logits = hf(torch.tensor([tokens])).logits[0, -1].float()
        output = torch.tensor(tokens[len(prompt) :], dtype=torch.long)
        counts = torch.bincount(output, minlength=len(logits)).float()
        logits = logits - frequency * counts - presence * (counts > 0)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


@torch.no_grad()
def test_penalties_match_transformers_and_the_formula(llm: LLM, hf) -> None:
    plain = [o.outputs[0].token_ids for o in run(llm, PROMPTS, greedy(16))]
    repeated = run(llm, PROMPTS, greedy(16, repetition_penalty=1.8))
    for prompt, out in zip(PROMPTS, repeated, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
        )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    params = greedy(12, presence_penalty=1.5, frequency_penalty=0.7)
    penalised = run(llm, PROMPTS, params)
    for prompt, out in zip(PROMPTS, penalised, strict=True):
        assert out.outputs[0].token_ids == hf_penalised_greedy(hf, prompt, 12, 1.5, 0.7)
    changed = [o.outputs[0].token_ids for o in repeated] + [
        o.outputs[0].token_ids for o in penalised
    ]
    assert any(
        t != p[: len(t)] for t, p in zip(changed, plain * 2, strict=True)
    )  # the penalties did something


def test_special_rows_do_not_change_the_others_and_are_batch_independent(llm: LLM) -> None:
    special = greedy(12, repetition_penalty=1.5, logit_bias={7: 3.0}, logprobs=2)
    alone = run(llm, PROMPTS[:1], special)[0].outputs[0]
    plain = [o.outputs[0].token_ids for o in run(llm, PROMPTS[1:], greedy(12))]
    mixed = run(llm, PROMPTS, [special, greedy(12), greedy(12)])
    assert mixed[0].outputs[0].token_ids == alone.token_ids
    assert [o.outputs[0].token_ids for o in mixed[1:]] == plain
    for a, b in zip(mixed[0].outputs[0].logprobs, alone.logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=ATOL) for t in a)


def test_logit_bias_moves_the_choice(llm: LLM, hf) -> None:
    forced = run(llm, PROMPTS[:1], greedy(6, logit_bias={42: 100.0}))[0].outputs[0]
    assert forced.token_ids == [42] * 6
    first = run(llm, PROMPTS[:1], greedy(1))[0].outputs[0].token_ids[0]
    banned = run(llm, PROMPTS[:1], greedy(1, logit_bias={first: -100.0}))[0].outputs[0]
    logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    logits[first] -= 100.0
    assert banned.token_ids == [int(logits.argmax())] != [first]


def test_min_tokens_holds_back_eos_and_stop_tokens(llm: LLM) -> None:
    to_eos = SamplingParams(temperature=0, max_tokens=10, logit_bias={EOS: 50.0})
    assert run(llm, PROMPTS[:1], to_eos)[0].outputs[0].token_ids == [EOS]
    out = run(llm, PROMPTS[:1], replace(to_eos, min_tokens=5))[0].outputs[0]
    assert len(out.token_ids) == 6 and EOS not in out.token_ids[:5] and out.token_ids[5] == EOS
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    stop = SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[42], logit_bias={42: 50.0}, min_tokens=3
    )
    out = run(llm, PROMPTS[:1], stop)[0].outputs[0]
    assert len(out.token_ids) == 4 and 42 not in out.token_ids[:3] and out.token_ids[3] == 42
    assert (out.finish_reason, out.stop_reason) == ("stop", 42)


def test_stop_token_text_stays_out_unless_asked(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    free = run(llm, PROMPTS[:1], greedy(12))[0].outputs[0].token_ids
    i = next(i for i in range(2, 12) if free[i] not in free[:i] and tokenizer.decode([free[i]]))
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[i]])
    out = run(llm, PROMPTS[:1], params)[0].outputs[0]
    assert out.token_ids == free[: i + 1] and out.stop_reason == free[i]
    assert out.text == tokenizer.decode(free[:i])
    kept = replace(params, include_stop_str_in_output=True)
    assert run(llm, PROMPTS[:1], kept)[0].outputs[0].text == tokenizer.decode(free[: i + 1])


def test_stop_strings_are_found_across_token_boundaries(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    free = run(llm, PROMPTS[:1], greedy(24))[0].outputs[0]
    i, stop, text = boundary_stop(tokenizer, free.token_ids)
    cut = text.find(stop)
    params = greedy(24, stop=[stop, "never appears \x00"])
    out = run(llm, PROMPTS[:1], params)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    assert out.token_ids == free.token_ids[: i + 2]  # up to the token that completes it
    kept = run(llm, PROMPTS[:1], greedy(24, stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[: cut + len(stop)]
    late = run(llm, PROMPTS[:1], greedy(24, stop=stop, min_tokens=i + 2))[0].outputs[0]
    assert len(late.token_ids) > i + 2  # not searched before min_tokens


def test_n_completions_differ_and_are_reproducible(llm: LLM, qwen3: Path) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    out = run(llm, PROMPTS[:1], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    choices = [c.token_ids for c in out.outputs]
    assert len({tuple(c) for c in choices}) == 3
    in_batch = run(llm, [PROMPTS[1], PROMPTS[0]], [greedy(12), params])[1]
    assert [c.token_ids for c in in_batch.outputs] == choices
    single = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    assert run(llm, PROMPTS[:1], single)[0].outputs[0].token_ids == choices[0]
    both = run(llm, PROMPTS[:1], greedy(8, n=2))[0].outputs
    assert (
        both[0].token_ids
        == both[1].token_ids
        == run(llm, PROMPTS[:1], greedy(8))[0].outputs[0].token_ids
    )
    assert all(c.finish_reason == "length" and c.text is not None for c in both)


def test_n_completions_share_the_prompt_through_the_prefix_cache(qwen3: Path) -> None:
    llm = LLM(qwen3, **SMALL, enable_prefix_caching=True)
    try:
        params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
        outs = run(llm, PROMPTS[1:2], params)[0].outputs
        assert len(outs) == 4
        block = llm.engine.runner.kv_plan.block_size
        cached = llm.engine.stats().num_cached_prompt_tokens
        assert cached >= 3 * (len(PROMPTS[1]) // block) * block
    finally:
        llm.close()


def test_skip_special_tokens(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    params = greedy(3, logit_bias={EOS: 50.0})
    out = run(llm, PROMPTS[:1], params)[0].outputs[0]
    assert out.token_ids == [EOS] * 3 and out.text == ""
    shown = run(llm, PROMPTS[:1], greedy(3, logit_bias={EOS: 50.0}, skip_special_tokens=False))
    assert shown[0].outputs[0].text == tokenizer.decode([EOS] * 3) != ""


def test_logit_bias_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids must be in \[0, {vocab}\)"):
        run(llm, PROMPTS[:2], [greedy(12), greedy(12, logit_bias={vocab: 1.0})])
    assert not llm.engine.has_unfinished_requests()
