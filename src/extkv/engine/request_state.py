"""What the engine keeps of one request between steps: a Sequence per completion (n of
them), the detokenizer that finds each one's stop strings, the logprobs gathered so far;
and the RequestOutput they make.

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
from extkv.engine.sampling_params import SamplingParams
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
    stream: TextStream | None  # with stop strings: the text, decoded as it grows
    logprobs: SampleLogprobs | None  # with `logprobs`: one dict per generated token
    cumulative_logprob: float = 0.0
    text: str | None = None  # decoded once finished


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
        self.completions = [
            Completion(
                seq,
                TextStream(
                    tokenizer,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
                if params.stop and tokenizer is not None
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
        # gather, stop strings to look for): else the engine skips `took_token` and
        # `add_logprobs` for it, every step.
        self.watches_tokens = params.logprobs is not None or any(
            c.stream is not None for c in self.completions
        )
        num_prompt = seqs[0].num_prompt_tokens
        self.prompt_logprobs: PromptLogprobs | None = (
            None if params.prompt_logprobs is None else [None] * num_prompt
        )

    @property
    def finished(self) -> bool:
        """Whether every completion has ended. Asked of every request that took a token,
        every step: a plain loop, a few times faster than all() over a generator."""
        for c in self.completions:  # noqa: SIM110
            if c.seq.status is not SequenceStatus.FINISHED:
                return False
        return True

    def took_token(self, completion: Completion) -> bool:
        """Feed the token the scheduler just appended to `completion` to its stop-string
        detokenizer; True when a stop string ends it (its `stop_reason` is then set, and
        the caller ends the sequence if the token did not already)."""
        seq, stream = completion.seq, completion.stream
        if stream is None:
            return False
        done = seq.status == SequenceStatus.FINISHED
        new = seq.output_token_ids[-1:]
        if done and seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            new = []  # the stop token's text stays out, as vLLM's
        search = len(seq.output_token_ids) > self.params.min_tokens
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
        """The request's RequestOutput now; the text of each finished completion (with
        `decode`: an errored request carries none)."""
        outputs = []
        for index, c in enumerate(self.completions):
            seq = c.seq
            if decode and c.text is None and seq.status == SequenceStatus.FINISHED:
                c.text = self._final_text(c)
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
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
        )

    def _final_text(self, completion: Completion) -> str | None:
        if self.tokenizer is None:
            return None
        if completion.stream is not None:
            return completion.stream.text
        seq = completion.seq
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token (EOS or one of stop_token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
