"""What the scheduler tells the model runner about one step: plain data, no `Sequence`.

The scheduler owns requests (their tokens, blocks and progress); the runner owns
the device (weights, KV cache, input buffers, sampling state). A `StepPlan` is
the whole contract between them, built once per step and read once by the
runner while it launches the step, so the runner never looks at a request's
bookkeeping and each side can change without the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from extkv.engine.block_tables import HostBlockTables
from extkv.engine.multimodal import ImageInput
from extkv.engine.sampling_params import SamplingParams


@dataclass(slots=True)  # one per request per step: cheap to build matters
class ScheduledRequest:
    """One request's part of a step: `num_new_tokens` tokens starting at position
    `num_computed_tokens` (the tokens before it have their KV in the cache).

    `token_ids` are the new tokens the host knows. With asynchronous scheduling the
    last one may still be on the device, sampled by the step before (`pending`): then
    `token_ids` has one fewer entry and the runner takes that token from its own
    record of the previous step's samples."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: list[int]
    pending: bool
    table_row: int  # its block tables' row of the plan's `block_tables`
    sampling: SamplingParams | None  # set when this step samples the request's next token
    # The request's tokens the host knows (prompt first; a reference, read while the step
    # launches), when penalties or prompt logprobs need them; else empty (a shared empty
    # tuple: no list built for every request of every step).
    history: Sequence[int] = ()
    num_prompt_tokens: int = 0
    banned_token_ids: tuple[int, ...] = ()  # masked this step (EOS and stops before min_tokens)
    prompt_logprobs: int | None = None  # top-k logprobs of the prompt positions this step computes
    # The images whose placeholder runs this step's tokens overlap: their embeddings (in the
    # encoder cache by the time the step runs) take those rows' places.
    images: tuple[ImageInput, ...] = ()

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this step has run."""
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """The positions whose logits this step computes and whose next token is the
        prompt's: their logprobs are the prompt logprobs of positions + 1."""
        if self.prompt_logprobs is None:
            return range(0)
        end = min(self.context_len, self.num_prompt_tokens - 1)
        return range(self.num_computed_tokens, max(end, self.num_computed_tokens))


@dataclass(frozen=True)
class StepPlan:
    """One step: all prefill (prompts or prompt chunks) or all decode (one token each).

    `new_request_ids` are scheduled for the first time, `resumed_request_ids` again
    after a preemption (their KV is recomputed from position 0), and
    `finished_request_ids` ended since the previous plan (finished or aborted): the
    runner drops what it kept for them. `block_tables` holds every request's tables
    (one per KV cache group, see KVCachePlan.groups), row `table_row` each; read while
    the step launches, before the scheduler changes them again.

    The encoder cache: the runner drops the entries `evicted_encoder_hashes` first, then
    encodes `encoder_inputs` (images no entry holds yet) into new ones."""

    is_prefill: bool
    requests: list[ScheduledRequest]
    block_tables: HostBlockTables | None = None  # None: a plan without requests
    new_request_ids: list[str] = field(default_factory=list)
    resumed_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    encoder_inputs: list[ImageInput] = field(default_factory=list)
    evicted_encoder_hashes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens the step feeds the model over all requests: what the token budget caps."""
        return sum(request.num_new_tokens for request in self.requests)

    @property
    def sampled(self) -> list[ScheduledRequest]:
        """The requests whose next token this step samples, in batch order: all of a
        decode's (the scheduler's decode requests always sample)."""
        if not self.is_prefill:
            return self.requests
        return [request for request in self.requests if request.sampling is not None]
