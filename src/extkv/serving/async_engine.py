"""The engine on a thread of its own, with asyncio on the other side of two queues.

The engine is not thread-safe and its steps block, so exactly one thread owns it.
Between steps it takes commands (add, abort) from a thread-safe inbox; after each
step it hands every request's text delta to the event loop in one callback.
Handlers never touch the engine: they `submit` and iterate the `RequestStream`.

A request whose step failed ends with `RequestFailedError` and the others carry on;
an error the engine cannot recover from (`EngineDeadError`, or any error escaping a
step) ends every request, and `alive` turns false for good (the server then exits).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import torch

from extkv.engine.errors import EngineDeadError, RequestFailedError
from extkv.engine.llm_engine import LLMEngine
from extkv.engine.outputs import RequestOutput
from extkv.engine.sampling_params import SamplingParams
from extkv.serving.detokenizer import TextStream
from extkv.serving.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The server holds as many requests as it may; the client should retry later."""


class ServerStoppingError(Exception):
    """The server is shutting down: the request was aborted before it finished."""


@dataclass
class Delta:
    """What one step added to a request (or, from `collect`, the whole request)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last delta: "stop", "length" or "abort"
    num_prompt_tokens: int
    num_output_tokens: int


class RequestStream:
    """The deltas of one request, in order. Leaving the iteration early (the client
    went away, the handler was cancelled) aborts the request, which frees its blocks."""

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta | Exception] = asyncio.Queue()
        self._abort = abort

    async def __aiter__(self) -> AsyncIterator[Delta]:
        done = False
        try:
            while not done:
                item = await self.queue.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            if not done:
                self._abort(self.request_id)


async def collect(stream: AsyncIterator[Delta]) -> Delta:
    """All of a request's deltas as one."""
    texts, token_ids = [], []
    async for delta in stream:
        texts.append(delta.text)
        token_ids += delta.token_ids
    return replace(delta, text="".join(texts), token_ids=token_ids)


@dataclass
class _Live:
    """A request as the engine thread tracks it."""

    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    text: TextStream
    arrival: float
    last_token_at: float | None = None
    num_output_tokens: int = 0


_STOP = None  # the inbox command that ends the engine thread


@dataclass(frozen=True)
class _AbortAll:
    """The inbox command that ends every request with `reason`."""

    reason: str


class AsyncEngine:
    """The LLMEngine on a thread of its own: handlers `submit` and abort through its inbox
    and read each request's deltas from a RequestStream."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_pending: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_pending = max_pending
        self.error: BaseException | None = None
        self._pending = 0  # submitted and not yet ended; event-loop side only
        self._inbox: queue.SimpleQueue[_Live | _AbortAll | str | None] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
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
        self._thread.start()

    def abort_all(self, reason: str) -> None:
        """End every request now with ServerStoppingError(reason); streams say so last."""
        self._inbox.put(_AbortAll(reason))

    async def stop(self) -> None:
        """End the engine thread after its current step, failing the requests left with
        ServerStoppingError; return once it has exited."""
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stop: list[str]
    ) -> RequestStream:
        """Queue a request for the engine thread; raise rather than queue past the limit."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        if self._pending >= self.max_pending:
            raise QueueFullError(
                f"the server is full: {self._pending} requests are running or queued, the most "
                f"that --max-pending-requests={self.max_pending} allows; retry later"
            )
        self._pending += 1
        stream = RequestStream(request_id, self._inbox.put)
        text = TextStream(self.engine.tokenizer, stop)
        self._inbox.put(_Live(stream, prompt_token_ids, params, text, time.monotonic()))
        return stream

    # --- event-loop side -------------------------------------------------------------

    def _deliver(self, items: list[tuple[RequestStream, Delta | Exception]]) -> None:
        for stream, item in items:
            stream.queue.put_nowait(item)
            if isinstance(item, Exception) or item.finish_reason is not None:
                self._pending -= 1

    # --- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        if self.engine.config.device.type == "cuda":
            torch.cuda.set_device(self.engine.config.device)  # a new thread starts on device 0
        try:
            while self._take_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                self.metrics.update_engine(self.engine.stats())
            self._fail_all(ServerStoppingError("the server is shutting down"))
        except Exception as e:
            logger.exception("The engine failed; failing every request from now on.")
            self.error = e
            dead = EngineDeadError(f"the engine failed: {e!r}")
            self._fail_all(dead)
            while (command := self._inbox.get()) is not _STOP:  # so that no request waits
                if isinstance(command, _Live):
                    self._post([(command.stream, dead)])

    def _take_commands(self, block: bool) -> bool:
        """Apply every queued command, waiting for one if `block`; False on stop."""
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while command is not _STOP:
            if isinstance(command, _Live):
                self._add(command)
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

    def _add(self, live: _Live) -> None:
        request_id = live.stream.request_id
        try:
            self.engine.add_request(live.prompt_token_ids, live.params, request_id=request_id)
        except EngineDeadError:
            raise
        except ValueError as e:  # the request's fault: a 400
            self._post([(live.stream, e)])
            return
        except Exception as e:  # a bug, but this request's alone
            logger.exception("Could not add request %s.", request_id)
            self._post([(live.stream, RequestFailedError(request_id, f"{type(e).__name__}: {e}"))])
            return
        self._live[request_id] = live
        self.metrics.prompt_tokens.inc(len(live.prompt_token_ids))

    def _abort(self, request_id: str, error: Exception | None = None) -> None:
        """Stop a request; its stream ends with `error`, or an "abort" delta."""
        live = self._live.pop(request_id, None)
        if live is None:
            return  # it finished before the abort arrived
        self.engine.abort_request(request_id)
        self.metrics.finished.labels("abort").inc()
        self._post([(live.stream, error or self._delta(live, "", [], "abort"))])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        items = []
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            if output.error is not None:  # its step failed; the engine freed its blocks
                del self._live[output.request_id]
                self.metrics.finished.labels("error").inc()
                items.append((live.stream, RequestFailedError(output.request_id, output.error)))
                continue
            completion = output.outputs[0]
            new = completion.token_ids[live.num_output_tokens :]
            live.num_output_tokens = len(completion.token_ids)
            self._observe_latency(live, now, len(new))
            text = live.text.add(new, output.finished)
            reason = completion.finish_reason if output.finished else None
            if live.text.stopped:
                if not output.finished:
                    self.engine.abort_request(output.request_id)
                reason = "stop"
            if reason is not None:
                del self._live[output.request_id]
                self.metrics.finished.labels(reason).inc()
            items.append((live.stream, self._delta(live, text, new, reason)))
        self._post(items)

    def _observe_latency(self, live: _Live, now: float, num_new: int) -> None:
        if live.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - live.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - live.last_token_at)
        live.last_token_at = now
        self.metrics.generation_tokens.inc(num_new)

    @staticmethod
    def _delta(live: _Live, text: str, new: list[int], reason: str | None) -> Delta:
        return Delta(text, new, reason, len(live.prompt_token_ids), live.num_output_tokens)

    def _fail_all(self, error: Exception) -> None:
        self._post([(live.stream, error) for live in self._live.values()])
        self._live.clear()

    def _post(self, items: list[tuple[RequestStream, Delta | Exception]]) -> None:
        if items:
            self._loop.call_soon_threadsafe(self._deliver, items)
