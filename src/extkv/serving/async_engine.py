"""The engine on a thread of its own, with asyncio on the other side of two queues.

The engine is not thread-safe and its steps block, so exactly one thread owns it.
Between steps it takes commands (add, abort, and `control`: a call on the engine
such as a KV cache resize or sleep, at once or once no request is left) from a
thread-safe inbox; after each step it hands every request's delta (the engine's own:
its requests ask for DELTA outputs, so a step costs what it added, however long the
answers grew) to the event loop in one callback. Handlers never touch the engine: they
`submit` and iterate the `RequestStream`, or await `control`. While idle it also wakes
when the elastic KV cache policy may give memory back.

A request whose step failed ends with `RequestFailedError` and the others carry on;
an error the engine cannot recover from (`EngineDeadError`, or any error escaping a
step) ends every request, and `alive` turns false for good (the server then exits).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from extkv.engine.errors import (
    EngineAsleepError,
    EngineDeadError,
    EngineStateError,
    RequestFailedError,
)
from extkv.engine.llm_engine import LLMEngine
from extkv.engine.multimodal import ImageInput
from extkv.engine.outputs import PromptLogprobs, RequestOutput, SampleLogprobs
from extkv.engine.sampling_params import RequestOutputKind, SamplingParams
from extkv.serving.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The server holds as many requests as it may; the client should retry later."""


class ServerStoppingError(Exception):
    """The server is shutting down: the request was aborted before it finished."""


@dataclass
class Delta:
    """What one step added to one choice (or, from `collect`, the whole choice)."""

    index: int  # the choice's place in the response
    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the choice's last delta: "stop", "length" or "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: SampleLogprobs | None = None  # of `token_ids`, when asked for
    prompt_logprobs: PromptLogprobs | None = None  # on the choice's first delta, when asked
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def then(self, later: Delta) -> Delta:
        """This delta and the next one of the same choice, as one."""
        return replace(
            later,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=None if later.logprobs is None else (self.logprobs or []) + later.logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass
class EngineRequest:
    """One engine request of an API request: a prompt (its images preprocessed, their
    placeholders expanded) and its `params.n` choices, numbered from `first_index` in the
    response."""

    prompt_token_ids: list[int]
    params: SamplingParams
    first_index: int
    images: list[ImageInput] = field(default_factory=list)


class RequestStream:
    """The deltas of one API request's choices (of one or more engine requests), each
    choice's in order. Leaving the iteration early (the client went away, the handler was
    cancelled, one engine request failed) aborts them all, which frees their blocks."""

    def __init__(
        self, request_ids: list[str], num_choices: int, abort: Callable[[str], None]
    ) -> None:
        self.request_ids = request_ids
        self.num_choices = num_choices
        self.queue: asyncio.Queue[Delta | Exception] = asyncio.Queue()
        self._abort = abort

    async def __aiter__(self) -> AsyncIterator[Delta]:
        left = self.num_choices
        try:
            while left:
                item = await self.queue.get()
                if isinstance(item, Exception):
                    raise item
                left -= item.finish_reason is not None
                yield item
        finally:
            if left:  # an abort of a request that already ended does nothing
                for request_id in self.request_ids:
                    self._abort(request_id)


async def collect(stream: AsyncIterator[Delta], num_choices: int) -> list[Delta]:
    """Each choice's deltas as one, in index order."""
    whole: list[Delta | None] = [None] * num_choices
    async for delta in stream:
        before = whole[delta.index]
        whole[delta.index] = delta if before is None else before.then(delta)
    return whole


@dataclass
class _Choice:
    """One completion of an engine request as the engine thread tracks it."""

    index: int  # in the response
    num_output_tokens: int = 0
    finished: bool = False


@dataclass
class _Live:
    """An engine request as the engine thread tracks it: one prompt and its choices."""

    request_id: str
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    arrival: float
    images: list[ImageInput]
    last_token_at: float | None = None
    # With prompt logprobs: the engine's first output carries them, each choice's first
    # delta shows them.
    prompt_logprobs: PromptLogprobs | None = None

    def unfinished(self) -> int:
        """How many of its choices have not ended yet."""
        return sum(not c.finished for c in self.choices)


# What the engine thread hands the event loop: a stream, its next item, and how many of
# the server's pending choices that item ends (for the --max-pending-requests count).
_Item = tuple[RequestStream, Delta | Exception, int]

_STOP = None  # the inbox command that ends the engine thread


@dataclass(frozen=True)
class _AbortAll:
    """The inbox command that ends every request with `reason`."""

    reason: str


@dataclass(frozen=True)
class _Control:
    """The inbox command that runs `call(engine)` between steps (with `when_idle`, once no
    request is left, new ones refused meanwhile) and settles `future` with its outcome."""

    call: Callable[[LLMEngine], Any]
    future: asyncio.Future
    when_idle: bool


GIL_SWITCH_INTERVAL_S = 0.0005


class AsyncEngine:
    """The LLMEngine on a thread of its own: handlers `submit` and abort through its inbox
    and read each request's deltas from a RequestStream."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_pending: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self.error: BaseException | None = None
        self._pending = 0  # submitted and not yet ended; event-loop side only
        self._inbox: queue.SimpleQueue[_Live | _AbortAll | _Control | str | None] = (
            queue.SimpleQueue()
        )
        self._live: dict[str, _Live] = {}  # engine thread only
        self._held: list[_Control] = []  # waiting for the engine to be idle; engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="extkv-engine", daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and has not failed; false before `start`, after
        `stop`, and for good after a failure."""
        return self._thread.is_alive() and self.error is None

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self.metrics.update_engine(self.engine.stats())  # capacity shown before the first request
        # The engine thread runs Python between device steps; by default it hands the GIL
        # to a waiting thread only every 5 ms, so the event loop (woken by a step's
        # deltas) would wait out several 1-3 ms steps and send their tokens in one burst.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread.start()

    def abort_all(self, reason: str) -> None:
        """End every request now with ServerStoppingError(reason); streams say so last."""
        self._inbox.put(_AbortAll(reason))

    async def stop(self) -> None:
        """End the engine thread after its current step, failing the requests left with
        ServerStoppingError; return once it has exited."""
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    async def control(self, call: Callable[[LLMEngine], Any], when_idle: bool = False) -> Any:
        """`call(engine)` on the engine thread between two steps (with `when_idle`, once every
        request has finished, refusing new ones meanwhile); its result, or its error."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        future = self._loop.create_future()
        self._inbox.put(_Control(call, future, when_idle))
        return await future

    def submit(self, request_id: str, requests: list[EngineRequest]) -> RequestStream:
        """Queue the engine requests of one API request, which share a stream; raise
        rather than queue past the limit, counted in choices."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        num_choices = sum(r.params.n for r in requests)
        if self._pending + num_choices > self.max_pending:
            raise QueueFullError(
                f"the server is full: {self._pending} choices are running or queued and "
                f"this request adds {num_choices}, past the {self.max_pending} that "
                f"--max-pending-requests={self.max_pending} allows; retry later"
            )
        self._pending += num_choices
        ids = [request_id]
        if len(requests) > 1:
            ids = [f"{request_id}-{i}" for i in range(len(requests))]
        stream = RequestStream(ids, num_choices, self._inbox.put)
        now = time.monotonic()
        for engine_id, request in zip(ids, requests, strict=True):
            params = replace(request.params, output_kind=RequestOutputKind.DELTA)
            choices = [_Choice(request.first_index + j) for j in range(params.n)]
            live = _Live(
                engine_id, stream, request.prompt_token_ids, params, choices, now, request.images
            )
            self._inbox.put(live)
        return stream

    # --- event-loop side -------------------------------------------------------------

    def _deliver(self, items: list[_Item]) -> None:
        for stream, item, num_ended in items:
            stream.queue.put_nowait(item)
            self._pending -= num_ended

    # --- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        if self.engine.config.device.type == "cuda":
            torch.cuda.set_device(self.engine.config.device)  # a new thread starts on device 0
        try:
            while self._take_commands(self._idle_wait()):
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                if self._held and not self.engine.has_unfinished_requests():
                    held, self._held = self._held, []
                    for command in held:
                        self._control(command)
                self.metrics.update_engine(self.engine.stats())
            self._fail_all(ServerStoppingError("the server is shutting down"))
        except Exception as e:
            logger.exception("The engine failed; failing every request from now on.")
            self.error = e
            dead = EngineDeadError(f"the engine failed: {e!r}")
            self._fail_all(dead)
            while (command := self._inbox.get()) is not _STOP:  # so that no request waits
                if isinstance(command, _Live):
                    self._post([(command.stream, dead, command.unfinished())])
                elif isinstance(command, _Control):
                    self._settle(command.future, dead)

    def _idle_wait(self) -> float | None:
        """How long to wait for a command: 0 while requests run; when idle, until the KV
        cache policy may next give memory back (None: until a command comes)."""
        if self.engine.has_unfinished_requests():
            return 0
        wait = self.engine.release_idle_kv_cache()
        self.metrics.update_engine(self.engine.stats())  # what it gave back, shown now
        return wait

    def _take_commands(self, wait: float | None) -> bool:
        """Apply every queued command, waiting `wait` seconds for one (None: as long as it
        takes); False on stop."""
        try:
            command = self._inbox.get(block=wait != 0, timeout=wait)
        except queue.Empty:
            return True
        while command is not _STOP:
            if isinstance(command, _Live):
                self._add(command)
            elif isinstance(command, _Control):
                if command.when_idle and self.engine.has_unfinished_requests():
                    self._held.append(command)  # run by the loop once the requests are done
                else:
                    self._control(command)
            elif isinstance(command, _AbortAll):
                for request_id in list(self._live):
                    self._abort(request_id, ServerStoppingError(command.reason))
            else:
                self._abort(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _control(self, command: _Control) -> None:
        try:
            result = command.call(self.engine)
        except EngineDeadError:
            raise
        except Exception as e:  # refused, or failed: the caller's to report
            self._settle(command.future, e)
        else:
            self._settle(command.future, result)

    def _settle(self, future: asyncio.Future, outcome: object) -> None:
        def settle() -> None:
            if future.cancelled():
                return
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        self._loop.call_soon_threadsafe(settle)

    def _add(self, live: _Live) -> None:
        request_id = live.request_id
        if self._held:  # draining for a call that needs the engine idle (sleep)
            refusal = EngineAsleepError("the engine is about to sleep: retry after /wake_up")
            self._post([(live.stream, refusal, live.unfinished())])
            return
        try:
            self.engine.add_request(
                live.prompt_token_ids, live.params, request_id=request_id, images=live.images
            )
        except EngineDeadError:
            raise
        except (ValueError, EngineStateError) as e:  # the request's fault, or asleep: a 4xx/503
            self._post([(live.stream, e, live.unfinished())])
            return
        except Exception as e:  # a bug, but this request's alone
            logger.exception("Could not add request %s.", request_id)
            failure = RequestFailedError(request_id, f"{type(e).__name__}: {e}")
            self._post([(live.stream, failure, live.unfinished())])
            return
        self._live[request_id] = live
        self.metrics.prompt_tokens.inc(len(live.prompt_token_ids))

    def _abort(self, request_id: str, error: Exception | None = None) -> None:
        """Stop a request; its stream ends with `error`, or an "abort" delta per choice."""
        live = self._live.pop(request_id, None)
        if live is None:
            return  # it finished before the abort arrived
        self.engine.abort_request(request_id)
        self.metrics.finished.labels("abort").inc()
        if error is not None:
            self._post([(live.stream, error, live.unfinished())])
            return
        left = [c for c in live.choices if not c.finished]
        self._post([(live.stream, self._delta(live, c, "", [], "abort"), 1) for c in left])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        items: list[_Item] = []
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            if output.error is not None:  # its step failed; the engine freed its blocks
                del self._live[output.request_id]
                self.metrics.finished.labels("error").inc()
                failure = RequestFailedError(output.request_id, output.error)
                items.append((live.stream, failure, live.unfinished()))
                continue
            deltas = self._choice_deltas(live, output, now)
            items += [(live.stream, d, d.finish_reason is not None) for d in deltas]
            if not live.unfinished():
                del self._live[output.request_id]
                self.metrics.finished.labels(deltas[-1].finish_reason).inc()
        self._post(items)

    def _choice_deltas(self, live: _Live, output: RequestOutput, now: float) -> list[Delta]:
        """What each choice gained in this step: the engine's DELTA output, which has the
        choices with something new (text as it is decoded, less what could still start a
        stop string; a choice's last delta completes it to the engine's final text)."""
        if output.prompt_logprobs is not None:
            live.prompt_logprobs = output.prompt_logprobs
        deltas = []
        num_new = 0
        for completion in output.outputs:
            choice = live.choices[completion.index]
            new = completion.token_ids
            first = choice.num_output_tokens == 0
            choice.num_output_tokens += len(new)
            num_new += len(new)
            choice.finished = completion.finish_reason is not None
            delta = self._delta(live, choice, completion.text or "", new, completion.finish_reason)
            delta.stop_reason = completion.stop_reason
            delta.logprobs = completion.logprobs
            if first:
                delta.prompt_logprobs = live.prompt_logprobs
            deltas.append(delta)
        self._observe_latency(live, now, num_new)
        return deltas

    def _observe_latency(self, live: _Live, now: float, num_new: int) -> None:
        if live.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - live.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - live.last_token_at)
        live.last_token_at = now
        self.metrics.generation_tokens.inc(num_new)

    @staticmethod
    def _delta(
        live: _Live, choice: _Choice, text: str, new: list[int], reason: str | None
    ) -> Delta:
        num_prompt = len(live.prompt_token_ids)
        return Delta(choice.index, text, new, reason, num_prompt, choice.num_output_tokens)

    def _fail_all(self, error: Exception) -> None:
        self._post([(live.stream, error, live.unfinished()) for live in self._live.values()])
        self._live.clear()
        for command in self._held:
            self._settle(command.future, error)
        self._held.clear()

    def _post(self, items: list[_Item]) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)
