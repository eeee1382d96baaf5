"""The engine loop: requests in, one scheduled step at a time, outputs out.

`LLM.generate` drives it to completion; a server drives it step by step. Between
steps its memory and weights can change (`resize_kv_cache`, `sleep`, `wake_up`,
`load_weights`: see extkv.engine.elastic; on every tensor-parallel rank), also by
itself under the elastic KV cache policy (extkv.engine.kv_policy).

With asynchronous scheduling (the default on one rank) each `step` launches the
next step before it reads the tokens of the one in flight, so scheduling and
building inputs on the host overlap the device's work instead of adding to it;
outputs then come one step later, and a sequence that stops on a stop token
computes one step for nothing. Greedy and seeded tokens are the same either way
(unseeded sampling shares one generator, so its tokens depend on the batch).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from extkv.distributed import SINGLE
from extkv.engine.block_manager import BlockManager
from extkv.engine.config import EngineConfig
from extkv.engine.elastic import SLEEP_LEVELS, ElasticMemory, KVCacheResize
from extkv.engine.encoder_cache import EncoderCacheManager
from extkv.engine.errors import EngineDeadError, EngineStateError, is_fatal
from extkv.engine.kv_policy import STATIC_STATUS, ElasticKVCachePolicy
from extkv.engine.model_runner import SampledTokens
from extkv.engine.multimodal import ImageInput, MultiModalProcessor
from extkv.engine.outputs import RequestOutput
from extkv.engine.request_state import RequestState, completion_ids, completion_params
from extkv.engine.sampling_params import SamplingParams
from extkv.engine.scheduler import Scheduler
from extkv.engine.sequence import Sequence, SequenceStatus
from extkv.engine.startup import MemoryReport, start_rank
from extkv.engine.stats import EngineStats
from extkv.engine.workers import start_workers
from extkv.models.hf_config import resolve_model

logger = logging.getLogger(__name__)


def _load_tokenizer(model: str):  # -> PreTrainedTokenizerBase | None
    """The model's tokenizer: its folder's files or its GGUF file's own; None without one."""
    source = resolve_model(model)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if source.gguf_file is None and not any(
        os.path.exists(os.path.join(source.path, n)) for n in names
    ):
        return None
    if source.gguf_file is not None:
        from extkv.models.gguf import gguf_tokenizer

        return gguf_tokenizer(source.path, source.gguf_file)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)


class LLMEngine:
    """Owns a model's ranks, KV cache, scheduler and tokenizer, and advances its requests one
    `step` at a time; not thread-safe: one caller drives it."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        # Tensor parallel: this process is rank 0; the other ranks start first (see
        # extkv.engine.workers) and start up alongside it.
        self.workers = start_workers(config) if config.tensor_parallel_size > 1 else None
        self._ranks = nullcontext if self.workers is None else self.workers.guard
        with self._ranks():
            group = SINGLE if self.workers is None else self.workers.group
            self.runner, self.kv_cache, self.report, facts = start_rank(config, group)
        if self.workers is not None:
            weakref.finalize(self, self.workers.stop)  # an engine dropped unclosed
        self.config = config
        self.vocab_size = facts.vocab_size
        self.block_manager = BlockManager(
            self.report.num_blocks, self.runner.kv_plan.groups, config.enable_prefix_caching
        )
        spec = self.runner.image_spec
        # Images: the checkpoint's processor turns them into encoder inputs; None without.
        self.multimodal: MultiModalProcessor | None = None
        encoder_cache = None
        if spec is not None:
            self.multimodal = MultiModalProcessor.from_pretrained(
                resolve_model(config.model).path, spec, config.limit_mm_per_prompt
            )
            encoder_cache = EncoderCacheManager(self.report.encoder_cache_tokens)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=frozenset(facts.eos_token_ids),
            encoder_cache=encoder_cache,
            whole_images=spec is not None and spec.bidirectional,
        )
        self.elastic = ElasticMemory(
            config, self.runner, self.kv_cache, self.scheduler, self._ranks
        )
        self.kv_policy: ElasticKVCachePolicy | None = None  # None: the static policy
        if config.kv_cache_policy == "elastic":
            self.kv_policy = ElasticKVCachePolicy(
                self.elastic, self.report.num_blocks_ceiling, config.kv_idle_release_s
            )
            self.scheduler.grow = self.kv_policy.grow
        self.tokenizer = _load_tokenizer(config.model)
        self._requests: dict[str, RequestState] = {}  # unfinished, by request id
        self._states: dict[str, RequestState] = {}  # the same, by each sequence's id
        self._num_watching = 0  # of them, those whose tokens need more than the scheduler
        self._num_streaming = 0  # of them, those that want an output every step (not FINAL_ONLY)
        self._ids = itertools.count()
        self._in_flight: SampledTokens | None = None  # launched, tokens not read yet
        self._closed = False
        self._dead: BaseException | None = None  # the error that made the engine unusable
        self.report.startup_seconds = time.perf_counter() - start
        logger.info("Engine ready in %.2f s.", self.report.startup_seconds)

    @property
    def memory_report(self) -> MemoryReport:
        """How start-up sized the KV cache and where its memory and time went."""
        return self.report

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state for metrics (cheap: call it every step)."""
        blocks = self.block_manager
        encoder = self.scheduler.encoder_cache
        return EngineStats(
            num_blocks_committed=blocks.num_blocks,
            num_blocks_capacity=self.report.num_blocks_capacity,
            num_blocks_used=blocks.num_used_blocks,
            kv_reserved_bytes=self.kv_cache.reserved_bytes,
            kv_committed_bytes=self.kv_cache.committed_bytes,
            graph_pool_bytes=self.report.graph_pool_bytes,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_cached_prompt_tokens=blocks.num_cached_tokens,
            num_steps=self.runner.num_steps,
            num_kv_grows=self.elastic.num_grows,
            num_kv_shrinks=self.elastic.num_shrinks,
            sleep_level=self.elastic.sleep_level,
            encoder_cache_tokens=0 if encoder is None else encoder.num_tokens,
            encoder_cache_used_tokens=0 if encoder is None else encoder.num_used_tokens,
            encoder_cache_entries=0 if encoder is None else encoder.num_entries,
            encoder_cache_hits=0 if encoder is None else encoder.num_hits,
            encoder_cache_misses=0 if encoder is None else encoder.num_misses,
        )

    # --- elastic memory (between steps) -------------------------------------------------

    def resize_kv_cache(
        self, num_blocks: int | None = None, memory_bytes: int | None = None
    ) -> KVCacheResize:
        """Grow or shrink the committed KV cache now, between two steps, under the captured
        graphs; requests decoding carry on (moved, or preempted and recomputed), their
        greedy tokens unchanged. See ElasticMemory.resize_kv_cache."""
        self._check_usable()
        with self._fatal_errors():
            return self.elastic.resize_kv_cache(num_blocks, memory_bytes)

    def kv_cache_status(self) -> dict[str, object]:
        """The KV cache now (committed, capacity, in use, resizes, what sleeps, the policy
        and its bounds), as a dict."""
        policy = STATIC_STATUS if self.kv_policy is None else self.kv_policy.status()
        return {**self.elastic.status(), **policy}

    def release_idle_kv_cache(self) -> float | None:
        """Let the elastic policy give back the KV cache's idle blocks (`step` does it after
        every step; an idle server calls this); the seconds until it should be called
        again, None when nothing is left to give back (or the policy is static)."""
        self._check_usable()
        if self.kv_policy is None:
            return None
        with self._fatal_errors():
            return self.kv_policy.release_idle()

    def sleep(self, level: int = 1, drain: bool = False) -> list[RequestOutput]:
        """Give back the KV cache's and the weights' memory (level 1: weights kept in host
        memory; level 2: dropped, filled again after wake by load_weights or from the
        checkpoint). Requests in flight are refused with EngineStateError, or with `drain`
        run to the end first: their final outputs are returned."""
        self._check_usable()
        if not self.config.enable_sleep_mode:
            raise EngineStateError("sleep needs enable_sleep_mode=True (--enable-sleep-mode)")
        level = SLEEP_LEVELS.check("level", level)
        if self._requests and not drain:
            raise EngineStateError(
                f"{len(self._requests)} request(s) in flight: let them finish, abort them, or "
                "sleep with drain=True"
            )
        outputs = self.drain()  # without requests: the tokens of a step still in flight
        with self._fatal_errors():
            self.elastic.sleep(level)
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map back the weights and/or the KV cache ("weights", "kv_cache"; None: both)
        under the addresses they had; requests are taken again once both are awake."""
        self._check_usable()
        if not self.config.enable_sleep_mode:
            raise EngineStateError("wake_up needs enable_sleep_mode=True (--enable-sleep-mode)")
        with self._fatal_errors():
            self.elastic.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache sleep (or, after a level-2 sleep, the
        parameters wait for `load_weights` or the checkpoint)."""
        return self.elastic.sleeping

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights ((checkpoint name, tensor) pairs) into the model in place, on every
        rank; see ElasticMemory.load_weights. Requests in flight are refused with
        EngineStateError (they would mix two models' KV)."""
        self._check_usable()
        if self._requests:
            raise EngineStateError(
                f"load_weights: {len(self._requests)} request(s) in flight; let them finish "
                "or abort them first"
            )
        self.drain()  # without requests: the tokens of a step still in flight
        with self._fatal_errors():
            self.elastic.load_weights(weights)

    def drain(self) -> list[RequestOutput]:
        """Step until no request is left; the final outputs of those that finish."""
        outputs = []
        while self.has_unfinished_requests():
            outputs += self.step(finished_only=True)
        return outputs

    def encode(self, prompt: str) -> list[int]:
        """Prompt text to token ids; a model without a tokenizer says to pass token ids instead."""
        if self.tokenizer is None:
            raise ValueError(
                f"prompts given as text need a tokenizer, and {self.config.model} has none; "
                "pass prompt_token_ids instead"
            )
        return self.tokenizer.encode(prompt)

    @property
    def image_placeholder(self) -> str | None:
        """The text of the model's image placeholder token (e.g. "<image>",
        "<start_of_image>"); None for a model without images (or without a tokenizer)."""
        spec = self.runner.image_spec
        if spec is None or self.tokenizer is None:
            return None
        return self.tokenizer.convert_ids_to_tokens(spec.placeholder_id)

    def process_multimodal(
        self, prompt_token_ids: list[int], multi_modal_data: Mapping[str, Any] | None
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids with each image placeholder expanded to its image's run, and the
        images ready for `add_request` (see MultiModalProcessor.process); ValueError for
        images given to a model without a vision encoder. Safe to call from any thread."""
        if self.multimodal is not None:
            return self.multimodal.process(prompt_token_ids, multi_modal_data)
        if multi_modal_data:
            raise ValueError(
                f"multi_modal_data: model {self.config.model} takes no images (it has no "
                "vision encoder)"
            )
        return list(prompt_token_ids), []

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
        images: Seq[ImageInput] = (),
    ) -> str:
        """Validate and queue one request; return its id. `images`: what
        `process_multimodal` made of the prompt's images (the ids expanded by it too)."""
        self._check_usable()
        self.elastic.check_awake("add_request")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty: every request needs at least one prompt token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
        bad += [t for t in ids if isinstance(t, int) and not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids must be ints in [0, {self.vocab_size}) (the vocabulary); "
                f"got {bad[:5]}"
            )
        outside = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias token ids must be in [0, {self.vocab_size}) (the vocabulary); "
                f"got {outside[:5]}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings need a tokenizer, and {self.config.model} has none; "
                "use stop_token_ids instead"
            )
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len={self.config.max_model_len} leaves "
                "no room to generate"
            )
        images = tuple(images)
        self._check_images(ids, images)
        request_id = request_id if request_id is not None else str(next(self._ids))
        seq_ids = completion_ids(request_id, params.n)
        if request_id in self._requests or any(i in self._states for i in seq_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs: list[Sequence] = []
        for index, seq_id in enumerate(seq_ids):
            leader = seqs[0] if seqs else None  # later completions share its prompt's blocks
            seqs.append(Sequence(seq_id, ids, completion_params(params, index), leader, images))
        state = RequestState(request_id, prompt, seqs, params, self.tokenizer)
        self._requests[request_id] = state
        self._num_watching += state.watches_tokens
        self._num_streaming += not state.final_only
        for seq in seqs:
            self._states[seq.request_id] = state
            self.scheduler.add(seq)
        return request_id

    def _check_images(self, ids: list[int], images: tuple[ImageInput, ...]) -> None:
        """Images must fill runs of image tokens in the prompt, in order, and every image
        token must belong to one (else its embedding would be the token's own)."""
        spec = self.runner.image_spec
        if spec is None:
            if images:
                raise ValueError(
                    f"images: model {self.config.model} takes no images (it has no vision encoder)"
                )
            return
        covered = 0
        for image in images:
            if not isinstance(image, ImageInput) or image.offset < covered:
                raise ValueError("images must be process_multimodal's, in prompt order")
            if ids[image.offset : image.end] != [spec.token_id] * image.length:
                raise ValueError(
                    f"images: positions {image.offset} to {image.end - 1} of the prompt are "
                    f"not all image tokens (id {spec.token_id})"
                )
            covered = image.end
        if ids.count(spec.token_id) != sum(image.length for image in images):
            raise ValueError(
                f"the prompt has {ids.count(spec.token_id)} image tokens (id {spec.token_id}), "
                f"and its images fill {sum(i.length for i in images)}: pass the prompt with its "
                "multi_modal_data (one placeholder per image)"
            )

    def abort_request(self, request_id: str) -> None:
        """Stop a request (every completion) and free its blocks (e.g. its client went away)."""
        state = self._requests.get(request_id)
        if state is not None:
            for c in state.completions:
                self.scheduler.abort(c.seq.request_id)
            self._forget(state)

    def _forget(self, state: RequestState) -> None:
        del self._requests[state.request_id]
        self._num_watching -= state.watches_tokens
        self._num_streaming -= not state.final_only
        for c in state.completions:
            del self._states[c.seq.request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has work left: a request waiting or running, or a launched step's
        tokens not read yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Launch the next scheduled step and read the tokens of the one before (or of
        this one, without asynchronous scheduling); return an output for every request
        that got a new token, as its `output_kind` asks (`finished` tells which are done),
        but for a FINAL_ONLY request only its final one; with `finished_only`, only the
        finished requests' (no per-step work for the others). A DELTA request's final
        output holds what no output held before: all of it when it had none.

        An error that only this step's requests met fails them (their outputs carry it,
        `finish_reason` "error") and the engine carries on; one that leaves the engine
        unusable (`is_fatal`) raises EngineDeadError, now and on every later call."""
        self._check_usable()
        with self._fatal_errors():
            outputs = self._step(finished_only)
            if self.kv_policy is not None:  # after the step: what it freed counts as freed now
                self.kv_policy.release_idle()
            return outputs

    @contextmanager
    def _fatal_errors(self) -> Iterator[None]:
        """An error that leaves the engine unusable (`is_fatal`: a device error, a lost
        tensor-parallel worker) becomes EngineDeadError, now and on every later call."""
        try:
            yield
        except Exception as e:
            if is_fatal(e):
                self._dead = e
                raise EngineDeadError(f"the engine cannot continue: {e}") from e
            raise

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        plan = self.scheduler.schedule()  # with the elastic policy, may grow the KV cache
        launched = None
        failed: list[RequestOutput] = []
        if plan is not None:
            try:
                with self._ranks():
                    launched = self.runner.execute(plan)
            except Exception as e:
                if is_fatal(e):
                    raise
                failed = self._fail([self._states[r.request_id] for r in plan.requests], e)
                if plan.encoder_inputs:  # their embeddings may not exist: computed again later
                    self.scheduler.encoder_cache.forget([i.hash for i in plan.encoder_inputs])
            else:
                self.scheduler.launched(plan)
        if self.config.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        if launched is None:
            return failed
        tokens = launched.get()
        # Every request that took a token gets an output, or only those finished: when no
        # request watches its tokens, those are the requests of the sequences update ended.
        streaming = not finished_only and self._num_streaming > 0
        every = streaming or self._num_watching > 0
        took, advanced = self._advancing(launched) if every else ({}, {})
        ended = self.scheduler.update(launched.request_ids, tokens)
        if not every:
            states = [self._states[seq.request_id] for seq in ended]
            advanced = {state.request_id: state for state in states}
        first = 0  # prompt logprobs, of chunks that sample nothing too
        for seq_id, position, count in launched.prompt_spans:
            if seq_id in self._states:
                self._states[seq_id].add_prompt_logprobs(
                    launched.prompt_logprobs, first, position, count
                )
            first += count
        outputs = []
        for state in advanced.values():
            try:
                if state.watches_tokens:
                    self._took_tokens(state, launched, took)
                finished = state.finished
                if finished or (streaming and not state.final_only):
                    outputs.append(state.output())
            except Exception as e:  # e.g. detokenizing: this request's alone
                failed += self._fail([state], e)
                continue
            if finished:
                self._forget(state)
        return outputs + failed

    def _advancing(
        self, launched: SampledTokens
    ) -> tuple[dict[str, int | None], dict[str, RequestState]]:
        """Before `update`: the sequences of `launched` that take a token (those finished
        or aborted since launch take none), each with its row among the step's logprobs
        (None: none asked), and their requests in order, once each. One pass: it runs for
        every sequence."""
        logprob_rows = {launched.request_ids[row]: i for i, row in enumerate(launched.logprob_rows)}
        took: dict[str, int | None] = {}
        advanced: dict[str, RequestState] = {}
        states, finished = self._states, SequenceStatus.FINISHED
        for seq_id in launched.request_ids:
            state = states.get(seq_id)
            if state is not None and state.by_id[seq_id].seq.status is not finished:
                took[seq_id] = logprob_rows.get(seq_id)
                advanced[state.request_id] = state
        return took, advanced

    def _took_tokens(
        self, state: RequestState, launched: SampledTokens, took: dict[str, int | None]
    ) -> None:
        """Hand `state` what the step gave its completions (tokens, logprobs); end the
        ones a stop string ended."""
        for c in state.completions:
            seq_id = c.seq.request_id
            if seq_id not in took:
                continue  # no token for it in this step
            if took[seq_id] is not None:
                state.add_logprobs(c, launched.logprobs, took[seq_id])
            if state.took_token(c) and c.seq.status != SequenceStatus.FINISHED:
                self.scheduler.abort(c.seq.request_id, reason="stop")

    def _fail(self, states: list[RequestState], error: Exception) -> list[RequestOutput]:
        """End the requests of `states` with `error` (their blocks freed); their final
        outputs."""
        states = list({id(s): s for s in states}.values())  # a request of n > 1 once
        logger.error(
            "A step failed for request(s) %s; failing them and carrying on: %r",
            [s.request_id for s in states],
            error,
        )
        outputs = []
        for state in states:
            if state.request_id not in self._requests:
                continue  # already ended
            for c in state.completions:
                self.scheduler.abort(c.seq.request_id, reason="error")
            output = state.output(decode=False)
            output.error = f"{type(error).__name__}: {error}"
            outputs.append(output)
            self._forget(state)
        return outputs

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed (LLM.close() was called); build a new one")
        if self._dead is not None:
            raise EngineDeadError(f"the engine cannot continue: {self._dead}")

    def close(self) -> None:
        """Give the device memory back (graphs, KV cache, weights) before the process ends;
        stop the tensor-parallel workers."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight is not None and self._dead is None:
            self._in_flight.get()  # the device may still be writing the KV cache
        self._in_flight = None
        if self.workers is not None:
            self.workers.stop()
        self.runner.release()
        self.kv_cache.free()
        if self.config.device.type == "cuda":
            torch.cuda.empty_cache()
