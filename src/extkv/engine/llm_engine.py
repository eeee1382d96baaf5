"""The engine loop: requests in, one scheduled step at a time, outputs out.

`LLM.generate` drives it to completion; a server drives it step by step.

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
from contextlib import nullcontext

import torch

from extkv.distributed import SINGLE
from extkv.engine.block_manager import BlockManager
from extkv.engine.config import EngineConfig
from extkv.engine.errors import EngineDeadError, is_fatal
from extkv.engine.model_runner import SampledTokens
from extkv.engine.outputs import CompletionOutput, RequestOutput
from extkv.engine.sampling_params import SamplingParams
from extkv.engine.scheduler import Scheduler
from extkv.engine.sequence import Sequence
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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        source.path, gguf_file=source.gguf_file, local_files_only=True
    )


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
            self.report.num_blocks, self.runner.kv_plan.needs, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=frozenset(facts.eos_token_ids),
        )
        self.tokenizer = _load_tokenizer(config.model)
        self._requests: dict[str, tuple[Sequence, str | None]] = {}
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
        )

    def encode(self, prompt: str) -> list[int]:
        """Prompt text to token ids; a model without a tokenizer says to pass token ids instead."""
        if self.tokenizer is None:
            raise ValueError(
                f"prompts given as text need a tokenizer, and {self.config.model} has none; "
                "pass prompt_token_ids instead"
            )
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue one request; return its id."""
        self._check_usable()
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
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len={self.config.max_model_len} leaves "
                "no room to generate"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params)
        self._requests[request_id] = (seq, prompt)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks (e.g. its client went away)."""
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has work left: a request waiting or running, or a launched step's
        tokens not read yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Launch the next scheduled step and read the tokens of the one before (or of
        this one, without asynchronous scheduling); return an output for every request
        that got a new token (`finished` tells which are done; only those carry text),
        or with `finished_only` just for the finished ones (no per-step copies).

        An error that only this step's requests met fails them (their outputs carry it,
        `finish_reason` "error") and the engine carries on; one that leaves the engine
        unusable (`is_fatal`) raises EngineDeadError, now and on every later call."""
        self._check_usable()
        try:
            return self._step(finished_only)
        except Exception as e:
            if is_fatal(e):
                self._dead = e
                raise EngineDeadError(f"the engine cannot continue: {e}") from e
            raise

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        launched = None
        failed: list[RequestOutput] = []
        if plan is not None:
            try:
                with self._ranks():
                    launched = self.runner.execute(plan)
            except Exception as e:
                if is_fatal(e):
                    raise
                failed = self._fail([self._requests[r.request_id][0] for r in plan.requests], e)
            else:
                self.scheduler.launched(plan)
        if self.config.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        if launched is None:
            return failed
        tokens = launched.get()
        # Requests finished or aborted since launch take no token (update skips them).
        advanced = [self._requests[i][0] for i in launched.request_ids if i in self._requests]
        finished = set(self.scheduler.update(launched.request_ids, tokens))
        if finished_only:
            advanced = [seq for seq in advanced if seq in finished]
        outputs = []
        for seq in advanced:
            try:
                outputs.append(self._output(seq, seq in finished))
            except Exception as e:  # e.g. detokenizing: this request's alone
                failed += self._fail([seq], e)
        for seq in finished:
            self._requests.pop(seq.request_id, None)
        return outputs + failed

    def _fail(self, seqs: list[Sequence], error: Exception) -> list[RequestOutput]:
        """End `seqs` with `error` (their blocks freed); their final outputs."""
        logger.error(
            "A step failed for request(s) %s; failing them and carrying on: %r",
            [seq.request_id for seq in seqs],
            error,
        )
        outputs = []
        for seq in seqs:
            if seq.request_id not in self._requests:
                continue  # already ended
            self.scheduler.abort(seq.request_id, reason="error")
            output = self._output(seq, finished=True, decode=False)
            output.error = f"{type(error).__name__}: {error}"
            outputs.append(output)
            del self._requests[seq.request_id]
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

    def _output(self, seq: Sequence, finished: bool, decode: bool = True) -> RequestOutput:
        tokens = list(seq.output_token_ids)
        text = None
        if finished and decode and self.tokenizer is not None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        completion = CompletionOutput(0, tokens, text, seq.finish_reason)
        prompt = self._requests[seq.request_id][1]
        return RequestOutput(seq.request_id, prompt, seq.prompt_token_ids, [completion], finished)
