"""What the engine keeps of one request between steps: a Sequence per completion (n of
them), the detokenizer that finds each one's stop strings, the logprobs gathered so far;
and the RequestOutputs they make, as its `output_kind` asks: everything so far
(CUMULATIVE), only what is new since the last output (DELTA: what a stream sends, at the
cost of what a step added rather than of the whole answer), or one output at the end
(FINAL_ONLY).

The logprobs come from the device as one small (rows, k + 1) tensor per step (see
`TopLogprobs`); here they only become vLLM's dicts, k + 1 entries per position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from extkv.engine.detokenizer import TextStream
from extkv.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from extkv.engine.sampler import TopLogprobs
from extkv.engine.sampling_params import RequestOutputKind, SamplingParams
from extkv.engine.sequence import Sequence, SequenceStatus
from extkv.options import INT64_MAX


def completion_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences: its own for one completion, else vLLM's
    `{index}_{request_id}` (the scheduler and the runner key everything by them)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def completion_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s parameters: one completion, its own seed (seed + index, as
    vLLM: each differs, each reproducible) and the prompt logprobs on the first only."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index) % (INT64_MAX + 1)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


@dataclass
class Completion:
    """One completion's sequence and what the engine gathers for it."""

    seq: Sequence
    # With stop strings (or DELTA outputs, and a tokenizer): the text, decoded as it grows.
    stream: TextStream | None
    logprobs: SampleLogprobs | None  # with `logprobs`: one dict per generated token
    cumulative_logprob: float = 0.0
    text: str | None = None  # decoded once finished
    # DELTA: the tokens (and their logprobs) and the characters already in an output,
    # and whether its end was.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    ended: bool = False


class RequestState:
    """One request: its completions, its prompt logprobs, and its output."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        seqs: list[Sequence],
        params: SamplingParams,
        tokenizer: Any | None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.tokenizer = tokenizer
        self.delta = params.output_kind is RequestOutputKind.DELTA
        # Whether `step` gives this request an output only once it has ended.
        self.final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        self.completions = [
            Completion(
                seq,
                TextStream(
                    tokenizer,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
                if (params.stop or self.delta) and tokenizer is not None
                else None,
                [] if params.logprobs is not None else None,
            )
            for seq in seqs
        ]
        self.by_id = {c.seq.request_id: c for c in self.completions}
        # Taken once: a streamed request's output is built every step, and its prompt
        # never changes.
        self.prompt_token_ids = seqs[0].prompt_token_ids
        # Whether a new token needs more than the scheduler's bookkeeping (logprobs to
        # gather, text to decode): else the engine skips `took_token` and `add_logprobs`
        # for it, every step.
        self.watches_tokens = params.logprobs is not None or any(
            c.stream is not None for c in self.completions
        )
        num_prompt = seqs[0].num_prompt_tokens
        self.prompt_logprobs: PromptLogprobs | None = (
            None if params.prompt_logprobs is None else [None] * num_prompt
        )
        self.prompt_logprobs_sent = False  # DELTA: they go in the first output only

    @property
    def finished(self) -> bool:
        """Whether every completion has ended. Asked of every request that took a token,
        every step: a plain loop, a few times faster than all() over a generator."""
        for c in self.completions:  # noqa: SIM110
            if c.seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    def took_token(self, completion: Completion) -> bool:
        """Feed the token the scheduler just appended to `completion` to its detokenizer;
        True when a stop string ends it (its `stop_reason` is then set, and the caller ends
        the sequence if the token did not already). O(1): it runs every step."""
        seq, stream = completion.seq, completion.stream
        if stream is None:
            return False
        done = seq.status == SequenceStatus.FINISHED
        new = seq.token_ids[-1:]
        if done and seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            new = []  # the stop token's text stays out, as vLLM's
        search = len(seq.token_ids) - seq.num_prompt_tokens > self.params.min_tokens
        stream.add(new, finished=done, search=search)
        if not stream.stopped:
            return False
        seq.stop_reason = stream.stop_reason
        return True

    def add_logprobs(self, completion: Completion, top: TopLogprobs, row: int) -> None:
        """The logprobs of `completion`'s newest token: row `row` of a step's `top`."""
        entry = self._entry(top, row, self.params.logprobs)
        completion.logprobs.append(entry)
        completion.cumulative_logprob += float(top.logprobs[row, 0])

    def add_prompt_logprobs(
        self, top: TopLogprobs, first_row: int, position: int, count: int
    ) -> None:
        """Prompt positions position..position + count - 1, from rows first_row on of
        `top` (a recomputation after a preemption writes the same values again)."""
        for i in range(count):
            self.prompt_logprobs[position + i] = self._entry(
                top, first_row + i, self.params.prompt_logprobs
            )

    def _entry(self, top: TopLogprobs, row: int, k: int) -> dict[int, Logprob]:
        """One position's dict: the chosen token first, then the top k (whose rank wins
        where the chosen token is among them)."""
        ids = top.token_ids[row, : k + 1].tolist()
        logprobs = top.logprobs[row, : k + 1].tolist()
        ranks = top.ranks[row, : k + 1].tolist()
        texts = self._decode_each(ids)
        return {
            t: Logprob(lp, rank, text)
            for t, lp, rank, text in zip(ids, logprobs, ranks, texts, strict=True)
        }

    def _decode_each(self, ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        return self.tokenizer.batch_decode([[t] for t in ids])

    def output(self, decode: bool = True) -> RequestOutput:
        """The request's RequestOutput now, as its output_kind asks; the text of each
        finished completion (with `decode`: an errored request carries none). DELTA: only
        the completions with something new, each with only that."""
        outputs = []
        for index, c in enumerate(self.completions):
            seq = c.seq
            done = seq.status is SequenceStatus.FINISHED
            if decode and c.text is None and done:
                c.text = self._final_text(c)
            if self.delta:
                if (output := self._delta(index, c, done)) is not None:
                    outputs.append(output)
                continue
            outputs.append(
                CompletionOutput(
                    index,
                    seq.output_token_ids,  # a slice: already the caller's own copy
                    c.text,
                    seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=None if c.logprobs is None else list(c.logprobs),
                    cumulative_logprob=None if c.logprobs is None else c.cumulative_logprob,
                )
            )
        prompt_logprobs = self.prompt_logprobs
        if self.delta:
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = True
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
        )

    def _delta(self, index: int, c: Completion, done: bool) -> CompletionOutput | None:
        """What completion `c` gained since the request's last output (DELTA), in O(new
        tokens), not O(all of them); None for nothing (or an end given before). Its text:
        while it runs, what its detokenizer has that can no longer begin a stop string;
        at its end, the rest of its final text."""
        seq = c.seq
        start = seq.num_prompt_tokens + c.num_sent_tokens
        if c.ended or not (done or len(seq.token_ids) > start):
            return None
        token_ids = seq.token_ids[start:]
        logprobs = None if c.logprobs is None else c.logprobs[c.num_sent_tokens :]
        c.num_sent_tokens += len(token_ids)
        text = None  # without a tokenizer, or for an errored request
        if done and c.text is not None:
            text = c.text[c.num_sent_chars :]
            c.num_sent_chars = len(c.text)
        elif not done and c.stream is not None:
            end = max(c.stream.num_safe_chars, c.num_sent_chars)
            text = c.stream.text[c.num_sent_chars : end]
            c.num_sent_chars = end
        c.ended = done
        return CompletionOutput(
            index,
            token_ids,
            text,
            seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=None if c.logprobs is None else c.cumulative_logprob,
        )

    def _final_text(self, completion: Completion) -> str | None:
        if self.tokenizer is None:
            return None
        if self.params.stop:  # what its detokenizer decoded, cut at the stop string
            return completion.stream.text
        seq = completion.seq
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token (EOS or one of stop_token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
