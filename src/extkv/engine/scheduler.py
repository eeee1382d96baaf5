"""Continuous batching over paged blocks.

Each step is either a prefill step (new prompts, or the next chunk of a long
one, within `max_num_batched_tokens`) or a decode step (one token for every
running sequence). Prefill goes first so new requests join the batch quickly.
When a decode needs a block and none is free, the most recently admitted
sequence is preempted: its blocks are freed and it recomputes later, which
gives the same tokens.

A step's life has two halves: `launched` records what the step computes when
it is sent to the device, `update` records the tokens it sampled once they
reach the host. With asynchronous scheduling the next step is planned and
launched in between, so the host's work hides behind the device's: tokens in
flight are pending (see `Sequence`), a sequence that an in-flight token will
finish by length is not scheduled again, one that it finishes by a stop token
has computed one step for nothing, and a sequence whose token is in flight
never preempts others for a block (it waits a step instead).

With the elastic KV cache policy, `grow` is asked for the missing blocks first, where a
request would otherwise wait or another be preempted for lack of them.

Prompts with images (see extkv.engine.encoder_cache): a prompt chunk that reaches into an
image's placeholder run needs the image's embeddings, held in the encoder cache or
computed in the step. Where the cache has no room for them (or the step's encoder budget
is spent), the chunk stops before that image; a request whose chunk would then be empty
is not admitted yet. A request holds its images until it has prefilled past their runs.
For a model whose image tokens attend to each other (`whole_images`: Gemma 3), a chunk also
never ends inside an image's run: it stops before an image it cannot hold whole (a prefix
cache hit may still end inside one: the tokens before it were computed with the whole
image).

Between steps the block pool can be resized (`resize`): to shrink it, the most
recently admitted sequences holding blocks past the new end are preempted until
the blocks held there fit into the free ones below it, and those move. A
sequence preempted with a token in flight is recomputed only once that token
has arrived.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

from extkv.engine.block_manager import BlockManager
from extkv.engine.encoder_cache import EncoderCacheManager
from extkv.engine.multimodal import ImageInput
from extkv.engine.sequence import Sequence, SequenceStatus
from extkv.engine.step_plan import ScheduledRequest, StepPlan

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides every step which requests run and how many tokens each computes, hands
    out their blocks (preempting when they run out) and tracks them to the end; it
    tells the runner by a `StepPlan`."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        encoder_cache: EncoderCacheManager | None = None,
        whole_images: bool = False,
    ) -> None:
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache  # None: a model without images
        self.whole_images = whole_images  # a chunk never ends inside an image's run
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._requests: dict[str, Sequence] = {}  # unfinished, by id
        self._planned: list[Sequence] = []  # the last plan's, in its order
        self._new: list[str] = []  # first scheduled in the plan being built
        self._resumed: list[str] = []  # scheduled again after a preemption
        self._finished: list[str] = []  # ended since the last plan
        # The elastic policy's: asked for this many more free blocks before a request is
        # left waiting or another is preempted; True if the pool grew (through `resize`).
        self.grow: Callable[[int], bool] | None = None
        self._encoder_inputs: list[ImageInput] = []  # the plan being built encodes these
        self._encode_budget = 0  # embeddings the plan being built may still encode

    def add(self, seq: Sequence) -> None:
        """Queue a new request; it waits until a prefill step admits it."""
        params = seq.params
        seq.max_length = min(seq.num_prompt_tokens + params.max_tokens, self.max_model_len)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seq.end_ids = eos.union(params.stop_token_ids)
        seq.plain_decode = not params.needs_context
        self.waiting.append(seq)
        self._requests[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        """Whether any request still waits or runs (tokens in flight are the engine's to count)."""
        return bool(self.waiting or self.running)

    def abort(self, request_id: str, reason: str = "abort") -> Sequence | None:
        """End a waiting or running request now with `reason`, freeing its blocks; None if it
        was not unfinished."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return seq
        return None

    def schedule(self) -> StepPlan | None:
        """The next step (None: nothing can run). It reads the block manager's tables, so
        it is valid until the block manager changes them (the next `launched`, `update`,
        `abort`, `resize` or call)."""
        cache = self.encoder_cache
        self._encode_budget = 0 if cache is None else cache.num_tokens
        step = self._schedule_prefill() or self._schedule_decode()
        while step is None and self._stalled():
            # Prompts wait on what others hold (blocks, an image's room): the youngest
            # gives all of it back and recomputes later, so the oldest always goes on.
            self._preempt(self.running[-1])
            step = self._schedule_prefill() or self._schedule_decode()
        if step is None:
            return None
        seqs, counts, is_prefill = step
        if is_prefill:
            requests = [self._scheduled(seq, n) for seq, n in zip(seqs, counts, strict=True)]
        else:
            requests = [self._scheduled_decode(seq) for seq in seqs]
        plan = StepPlan(
            is_prefill,
            requests,
            self.block_manager.tables,
            new_request_ids=self._new,
            resumed_request_ids=self._resumed,
            finished_request_ids=self._finished,
            encoder_inputs=self._encoder_inputs,
            evicted_encoder_hashes=[] if cache is None else cache.take_evicted(),
        )
        self._planned, self._new, self._resumed, self._finished = seqs, [], [], []
        self._encoder_inputs = []
        return plan

    def _scheduled(self, seq: Sequence, num_new_tokens: int) -> ScheduledRequest:
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        known = seq.token_ids[start:end]
        params = seq.params
        samples = end == len(seq)
        wants_history = params.has_penalties or params.prompt_logprobs is not None
        banned: tuple[int, ...] = ()
        if samples and len(seq) - seq.num_prompt_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self.eos_token_ids)
            banned = (*eos, *params.stop_token_ids)
        return ScheduledRequest(
            request_id=seq.request_id,
            num_computed_tokens=start,
            num_new_tokens=num_new_tokens,
            token_ids=known,
            pending=len(known) < num_new_tokens,
            table_row=seq.table_row,
            sampling=params if samples else None,
            history=seq.token_ids if wants_history else (),
            num_prompt_tokens=seq.num_prompt_tokens,
            banned_token_ids=banned,
            prompt_logprobs=params.prompt_logprobs,
            images=seq.images_in(start, end),
        )

    def _scheduled_decode(self, seq: Sequence) -> ScheduledRequest:
        """`_scheduled(seq, 1)` for a decode, which always samples: the hot path at large
        batches (one per running request per step), so it computes only what it must."""
        if not seq.plain_decode:
            return self._scheduled(seq, 1)  # needs its tokens or its banned ones
        start = seq.num_computed_tokens
        known = seq.token_ids[start : start + 1]  # empty: the token is still in flight
        return ScheduledRequest(
            seq.request_id, start, 1, known, not known, seq.table_row, seq.params
        )

    def _schedule_prefill(self) -> tuple[list[Sequence], list[int], bool] | None:
        seqs: list[Sequence] = []
        counts: list[int] = []
        budget = self.max_num_batched_tokens
        admitting = True  # waiting requests may start this step
        # A sequence whose prompt was cut into chunks goes on first.
        running = SequenceStatus.RUNNING
        for seq in list(self.running):
            if seq.status is not running or seq.num_uncomputed_tokens <= 1:
                continue  # preempted just now, or ready to decode
            start = seq.num_computed_tokens
            n = self._image_chunk(seq, start, min(seq.num_uncomputed_tokens, budget))
            if n == 0:
                continue  # waits for its image's room in the encoder cache
            if not self._make_room(seq, start + n, preempt_itself=False):
                # Waits, keeping its blocks, until a decode frees or takes them; a younger
                # request admitted now would take the blocks its preemptions just freed.
                admitting = False
                continue
            self._hold_images(seq, start, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        blocks = self.block_manager
        for seq in list(self.waiting if admitting else ()):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.num_pending or self._waits_for_leader(seq):
                continue  # preempted with a token in flight: recomputed once it is here
            # Prompt logprobs need every prompt position's logits: no cached prefix.
            cached = blocks.cached_prefix(seq) if seq.params.prompt_logprobs is None else []
            computed = len(cached[0]) * blocks.block_size if cached else seq.num_computed_tokens
            n = self._image_chunk(seq, computed, min(len(seq) - computed, budget))
            if n == 0 or not self._fits(seq, computed + n, reusing=cached):
                break
            self.waiting.remove(seq)
            if cached:
                blocks.reuse(seq, cached)
            blocks.allocate(seq, computed + n)
            self._hold_images(seq, computed, n)
            seq.status = SequenceStatus.RUNNING
            (self._resumed if seq.num_preemptions else self._new).append(seq.request_id)
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return (seqs, counts, True) if seqs else None

    def _image_chunk(self, seq: Sequence, start: int, num_tokens: int) -> int:
        """`num_tokens` from `start`, or fewer: up to the first image in them whose
        embeddings the encoder cache cannot take now, with the images before it (its room
        or this step's encoder budget is short), or, with `whole_images`, whose run they
        end inside."""
        cache = self.encoder_cache
        if cache is None or not seq.images:
            return num_tokens
        acquiring: set[str] = set()
        new: set[str] = set()
        new_tokens = 0
        for index, image in enumerate(seq.images):
            if image.offset >= start + num_tokens:
                break
            if image.end <= start or index in seq.encoder_held:
                continue
            if cache.has(image.hash):
                acquiring.add(image.hash)
            elif image.hash not in new:
                new.add(image.hash)
                new_tokens += image.length
            if new_tokens > self._encode_budget or not cache.can_allocate(new_tokens, acquiring):
                return max(image.offset - start, 0)
            if self.whole_images and image.end > start + num_tokens:
                return max(image.offset - start, 0)
        return num_tokens

    def _hold_images(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """Hold, in the encoder cache, the images `seq`'s tokens [start, start +
        num_tokens) reach into (`_image_chunk` made sure they fit): entries it has first,
        then new ones, which this step encodes."""
        cache = self.encoder_cache
        if cache is None or not seq.images:
            return
        fresh = [
            (index, image)
            for index, image in enumerate(seq.images)
            if index not in seq.encoder_held
            and image.offset < start + num_tokens
            and image.end > start
        ]
        for index, image in sorted(fresh, key=lambda pair: not cache.has(pair[1].hash)):
            if not cache.acquire(image.hash):
                cache.allocate(image.hash, image.length)
                self._encoder_inputs.append(image)
                self._encode_budget -= image.length
            seq.encoder_held.add(index)

    def _release_images(self, seq: Sequence, all_of_them: bool) -> None:
        """Drop `seq`'s holds on its images: those it has prefilled past, or all."""
        for index in sorted(seq.encoder_held):
            image = seq.images[index]
            if all_of_them or image.end <= seq.num_computed_tokens:
                self.encoder_cache.release(image.hash)
                seq.encoder_held.discard(index)

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """Whether `seq`, a later completion of a request with n > 1, waits for the first
        one's prompt to be computed, so that prefix caching hands it the prompt's blocks."""
        leader = seq.leader
        return (
            leader is not None
            and self.block_manager.prefix_caching
            and leader.status != SequenceStatus.FINISHED
            and leader.num_computed_tokens < leader.num_prompt_tokens
        )

    def _stalled(self) -> bool:
        """Whether a running prompt waits for its next chunk with another sequence running
        that holds what it lacks (nothing else was schedulable)."""
        waiting_prompt = any(seq.num_uncomputed_tokens > 1 for seq in self.running)
        return waiting_prompt and len(self.running) > 1

    def _schedule_decode(self) -> tuple[list[Sequence], list[int], bool] | None:
        seqs = []
        blocks = self.block_manager
        running = SequenceStatus.RUNNING
        for seq in list(self.running):
            if seq.status is not running:
                continue  # preempted just now to make room for an older sequence
            if seq.num_uncomputed_tokens > 1:
                continue  # a prompt whose next chunk waits (for blocks or an image's room)
            num_tokens = len(seq.token_ids) + seq.num_pending
            if seq.num_pending and num_tokens >= seq.max_length:
                continue  # its pending token is its last
            if blocks.holds(seq, num_tokens):  # most steps need no new block
                seqs.append(seq)
            elif seq.num_pending:
                # Its token in flight may finish it: wait a step rather than preempt others.
                if self._fits(seq, num_tokens):
                    blocks.allocate(seq, num_tokens)
                    seqs.append(seq)
            elif self._make_room(seq, num_tokens):
                seqs.append(seq)
        return (seqs, [1] * len(seqs), False) if seqs else None

    def _make_room(self, seq: Sequence, num_tokens: int, preempt_itself: bool = True) -> bool:
        """Give `seq` blocks for `num_tokens`, preempting younger sequences if needed.
        False if there was no room without preempting `seq` itself (which then happened,
        unless `preempt_itself` is off: a prompt chunk waits instead, since preempting
        it would only recompute the same chunks and starve the decodes)."""
        while not self._fits(seq, num_tokens):
            victim = self.running[-1]
            if victim is seq and not preempt_itself:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def _fits(self, seq: Sequence, num_tokens: int, reusing: Seq[Seq[int]] = ()) -> bool:
        """Whether the pool can give `seq` blocks for `num_tokens` (taking the cached
        tables `reusing`), once `grow` (the elastic policy) has added what it can."""
        blocks = self.block_manager
        short = blocks.blocks_short(seq, num_tokens, reusing)
        if short and self.grow is not None and self.grow(short):
            short = blocks.blocks_short(seq, num_tokens, reusing)
        return short == 0

    def resize(self, num_blocks: int) -> tuple[dict[int, int], int]:
        """Resize the block pool to `num_blocks`, preempting what must go to shrink it;
        return the block moves ({old: new}, every table already rewritten: the caller
        copies the blocks' contents before the next step) and how many sequences were
        preempted."""
        blocks = self.block_manager
        preempted = 0
        while blocks.num_held_from(num_blocks) > blocks.num_free_below(num_blocks):
            self._preempt(next(s for s in reversed(self.running) if _holds_from(s, num_blocks)))
            preempted += 1
        return blocks.resize(num_blocks), preempted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        if seq.encoder_held:
            self._release_images(seq, all_of_them=True)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug("preempted %s (%d tokens will be recomputed)", seq.request_id, len(seq))

    def launched(self, plan: StepPlan) -> None:
        """Record that `plan` (the last one made) went to the device: its tokens count as
        computed, and each request it samples has one more token pending."""
        remember = self.block_manager.prefix_caching
        windowed = bool(self.block_manager.windowed)
        for seq, request in zip(self._planned, plan.requests, strict=True):
            seq.num_computed_tokens += request.num_new_tokens
            if remember:
                self.block_manager.remember_computed(seq)
            if windowed:
                self.block_manager.release_out_of_window(seq)
            if seq.encoder_held:
                self._release_images(seq, all_of_them=False)
            if request.sampling is not None:
                seq.num_pending += 1

    def update(self, request_ids: list[str], tokens: list[int]) -> list[Sequence]:
        """Record the tokens a launched step sampled; return the sequences they finished."""
        finished = []
        remember = self.block_manager.prefix_caching
        for request_id, token in zip(request_ids, tokens, strict=True):
            seq = self._requests.get(request_id)
            if seq is None:
                continue  # aborted, or finished by a token of the step before
            seq.num_pending -= 1
            seq.token_ids.append(token)
            if remember:
                self.block_manager.remember_computed(seq)
            if token in seq.end_ids or len(seq.token_ids) >= seq.max_length:
                # Usually running; waiting if preempted while this token was in flight.
                (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
                self._finish(seq, self._finish_reason(seq, token))
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str:
        """Why `token` ended `seq` (one of its `end_ids`, or its length reached)."""
        if token not in seq.end_ids:
            return "length"
        if seq.params.ignore_eos or token not in self.eos_token_ids:
            seq.stop_reason = token  # one of stop_token_ids; no stop_reason for EOS, as vLLM
        return "stop"

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_pending = 0  # a token still in flight is dropped when read
        self.block_manager.free(seq)
        if seq.encoder_held:
            self._release_images(seq, all_of_them=True)
        del self._requests[seq.request_id]
        self._finished.append(seq.request_id)


def _holds_from(seq: Sequence, num_blocks: int) -> bool:
    """Whether `seq` holds a block from `num_blocks` on (released entries are NO_BLOCK, < 0)."""
    return any(b >= num_blocks for table in seq.block_tables for b in table)
