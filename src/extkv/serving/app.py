"""The OpenAI-compatible HTTP server: routes, API key, size limits, streaming, and
its life: started with the engine, stopped gracefully, gone when the engine dies.

Handlers parse and check a request, turn it into prompt token ids and
SamplingParams (parsing and tokenizing off the event loop; a chat message's images,
data: URLs or file:// URLs inside --allowed-local-media-path, are decoded and
preprocessed there too), and hand it to the `AsyncEngine`; they wait for its deltas
while watching the connection, so a client that goes away aborts its request. Guards
(`extkv.serving.guards`) come first.

Elastic memory, behind the API key: `GET /kv_cache` and `POST /kv_cache/resize`
always; `POST /sleep`, `POST /wake_up` and `GET /is_sleeping` only with
--enable-sleep-mode (else 404), as vLLM's. They run on the engine thread between
steps (`AsyncEngine.control`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from extkv import __version__
from extkv.engine.chat_content import MediaSources, chat_inputs, content_format
from extkv.engine.elastic import SLEEP_LEVELS, TAGS
from extkv.engine.errors import (
    EngineAsleepError,
    EngineDeadError,
    EngineStateError,
    RequestFailedError,
)
from extkv.engine.llm_engine import LLMEngine
from extkv.engine.multimodal import ImageInput
from extkv.engine.sampling_params import SamplingParams
from extkv.options import Bool, Choice, Kind
from extkv.serving.async_engine import (
    AsyncEngine,
    Delta,
    EngineRequest,
    QueueFullError,
    ServerStoppingError,
    collect,
)
from extkv.serving.guards import GuardedH11Protocol, LoopbackHostGuard, is_loopback
from extkv.serving.metrics import ServerMetrics
from extkv.serving.prompts import PromptEncoder
from extkv.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    KVCacheResizeRequest,
    Position,
    Reply,
    TokenizeRequest,
    chat_logprobs,
    check_prompt_length,
    completion_logprobs,
    parse_request,
    usage,
)
from extkv.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# After --shutdown-timeout, how long aborted requests have to send their last bytes
# before uvicorn cancels them (a client that does not read would hold them forever).
FLUSH_SECONDS = 5.0


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The ASGI app; it starts the engine thread on startup and stops it on shutdown.
    `app.state.engine` is its AsyncEngine."""
    server = _Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.prompts.start()
        server.engine.start()
        yield
        await server.engine.stop()
        server.prompts.close()

    app = FastAPI(title="extkv", lifespan=lifespan)
    app.state.engine = server.engine
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    if is_loopback(settings.host):
        app.add_middleware(LoopbackHostGuard)  # added last: runs first
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.check_api_key)])
    v1.post("/completions")(server.completions)
    v1.post("/chat/completions")(server.chat_completions)
    v1.get("/models")(server.models)
    app.include_router(v1)
    tokens = APIRouter(dependencies=[Depends(server.check_api_key)])
    tokens.post("/tokenize")(server.tokenize)
    tokens.post("/detokenize")(server.detokenize)
    app.include_router(tokens)
    admin = APIRouter(dependencies=[Depends(server.check_api_key)])
    admin.get("/kv_cache")(server.kv_cache)
    admin.post("/kv_cache/resize")(server.resize_kv_cache)
    if engine.config.enable_sleep_mode:
        admin.post("/sleep")(server.sleep)
        admin.post("/wake_up")(server.wake_up)
        admin.get("/is_sleeping")(server.is_sleeping)
    app.include_router(admin)
    app.get("/version")(server.version)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    return app


def make_server(
    engine: LLMEngine, settings: ServerSettings, log_level: str = "info"
) -> EngineServer:
    """The app under uvicorn, with the guards and the life `EngineServer` gives it."""
    app = build_app(engine, settings)
    protocol = functools.partial(
        GuardedH11Protocol,
        read_timeout=settings.request_read_timeout,
        max_connections=settings.max_connections,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,  # type: ignore[arg-type]  # a protocol factory, as uvicorn calls it
        timeout_graceful_shutdown=settings.shutdown_timeout + FLUSH_SECONDS,  # type: ignore[arg-type]
        log_config=None,
        log_level=log_level.lower(),
    )
    return EngineServer(config, app.state.engine, settings.shutdown_timeout)


def run_server(engine: LLMEngine, settings: ServerSettings, log_level: str = "info") -> int:
    """Serve until SIGTERM or SIGINT (then the exit status is 0) or until the engine dies
    (1, so that a supervisor restarts it). Call from the main thread."""
    host, port = settings.host, settings.port
    if not is_loopback(host) and settings.api_key is None:
        logger.warning("Serving on %s without --api-key: whoever reaches it can use it.", host)
    logger.info("Serving %s on http://%s:%d/v1", settings.model_name, host, port)
    server = make_server(engine, settings, log_level)
    # uvicorn raises the signal it caught again once it has shut down, so that the handler
    # it replaced runs; that handler is this no-op: the shutdown was graceful, the exit 0.
    previous = {sig: signal.signal(sig, _shut_down_already) for sig in _STOP_SIGNALS}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.engine.error is None else 1


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _shut_down_already(signum: int, frame: object) -> None:
    logger.info("Stopped on %s.", signal.Signals(signum).name)


class EngineServer(uvicorn.Server):
    """uvicorn's server, tied to the engine: it stops when the engine dies, and its
    graceful shutdown (stop accepting, let running requests finish) lasts at most
    `shutdown_timeout` seconds before the requests left are aborted, so that streams
    end with an error chunk instead of being cut."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's periodic check, which also starts a graceful exit once the engine is dead."""
        if self.started and not self.should_exit and not self.engine.alive:
            logger.error("The engine is dead; stopping the server.")
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown, aborting what still runs after `shutdown_timeout` so
        that those streams end with an error chunk."""
        reason = f"the server is shutting down (--shutdown-timeout={self.shutdown_timeout:g})"
        loop = asyncio.get_running_loop()
        abort = loop.call_later(self.shutdown_timeout, self.engine.abort_all, reason)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()


class _Server:
    def __init__(self, engine: LLMEngine, settings: ServerSettings) -> None:
        self.settings = settings
        self._metrics = ServerMetrics()
        self.engine = AsyncEngine(engine, self._metrics, settings.max_pending_requests)
        self.max_model_len = engine.config.max_model_len
        self.textless = engine.tokenizer is None  # token ids in, token ids out
        template = settings.chat_template_text()
        self.prompts = PromptEncoder(
            engine.tokenizer, settings.model_name, self.max_model_len, template
        )
        # Images: how the chat template takes a message's parts, the placeholder text an
        # image part becomes, the folder file:// URLs may read; the engine's preprocessing.
        template = template or getattr(engine.tokenizer, "chat_template", None)
        self.content_format = content_format(template)
        self.image_placeholder = engine.image_placeholder
        self.media_sources = MediaSources.of(engine.config)
        self.takes_images = engine.multimodal is not None
        self.process_multimodal = engine.process_multimodal
        self.created = int(time.time())

    async def check_api_key(self, request: Request) -> None:
        if self.settings.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.settings.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        given = body.prompts
        prompts = await asyncio.gather(*map(self._prompt_ids, given))
        # No images here: a placeholder in a prompt is refused (the chat endpoint takes them).
        prompts = [(await self._with_images(p, [], "prompt"))[0] for p in prompts]
        echo = None
        if body.echo:  # the prompt's text as sent, or its token ids decoded
            texts = await asyncio.gather(*map(self._prompt_text, given, prompts))
            first_tokens = None
            if body.logprobs is not None:
                decode = self.prompts.decode
                first_tokens = await asyncio.gather(
                    *(decode(p[:1], "prompt", False) for p in prompts)
                )
            echo = _Echo(texts, first_tokens)
        return await self._generate(request, body, prompts, body.max_tokens, echo)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        prompt, images = await self._chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(request, body, [prompt], max_tokens, images=[images])

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt's or chat's token ids, their count and the limit."""
        body = await self._parse(request, TokenizeRequest)
        self._check_model(body.model)
        if body.prompt is not None:
            special = body.add_special_tokens is not False
            ids = await self.prompts.encode(body.prompt, "prompt", special, whole=True)
        else:
            generation, special = body.add_generation_prompt, bool(body.add_special_tokens)
            ids, _ = await self._chat_prompt(body.messages or [], generation, special, whole=True)
        strs = await self.prompts.token_strs(ids) if body.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids back to text, special tokens kept."""
        body = await self._parse(request, DetokenizeRequest)
        self._check_model(body.model)
        text = await self.prompts.decode(body.tokens, "tokens", skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    async def version(self) -> Response:
        return JSONResponse({"version": __version__})

    async def models(self) -> Response:
        card = {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "extkv",
            "max_model_len": self.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self) -> Response:
        alive = self.engine.alive
        return JSONResponse({"status": "ok" if alive else "engine down"}, 200 if alive else 503)

    async def metrics(self) -> Response:
        return Response(self._metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def kv_cache(self) -> Response:
        """The KV cache now: blocks committed, capacity and in use, bytes, resizes."""
        with _engine_errors():
            status = await self.engine.control(LLMEngine.kv_cache_status)
        return JSONResponse(status)

    async def resize_kv_cache(self, request: Request) -> Response:
        """Grow or shrink the committed KV cache between two steps: {"num_blocks": N} or
        {"memory_bytes": M}; the answer says what was committed."""
        body = await self._parse(request, KVCacheResizeRequest)
        with _engine_errors():
            report = await self.engine.control(
                lambda e: e.resize_kv_cache(body.num_blocks, body.memory_bytes)
            )
        return JSONResponse(report.as_dict())

    async def sleep(self, request: Request) -> Response:
        """vLLM's /sleep?level=N (1 or 2); `drain=true` lets running requests finish first,
        refusing new ones meanwhile (else requests in flight are a 409)."""
        level = _query(request, "level", SLEEP_LEVELS, 1)
        drain = _query(request, "drain", Bool(), False)
        with _engine_errors():
            await self.engine.control(lambda e: e.sleep(level), when_idle=drain)
        return JSONResponse({"is_sleeping": True, "level": level})

    async def wake_up(self, request: Request) -> Response:
        """vLLM's /wake_up, `tags` (repeatable: weights, kv_cache) naming what to wake."""
        kind = Choice(TAGS)
        given = request.query_params.getlist("tags")
        tags = [_check_query("tags", kind, kind.parse(t)) for t in given] or None

        def wake(engine: LLMEngine) -> bool:
            engine.wake_up(tags)
            return engine.is_sleeping()

        with _engine_errors():
            sleeping = await self.engine.control(wake)
        return JSONResponse({"is_sleeping": sleeping})

    async def is_sleeping(self) -> Response:
        with _engine_errors():
            sleeping = await self.engine.control(LLMEngine.is_sleeping)
        return JSONResponse({"is_sleeping": sleeping})

    async def _chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        whole: bool = False,
    ) -> tuple[list[int], list[ImageInput]]:
        """The ids of the chat template applied to `messages` (images expanded to their
        placeholder runs) and the images; a 400 naming `messages` for an image that cannot
        be had or is not wanted. `whole` as in PromptEncoder.encode."""
        raw = [m.as_dict() for m in messages]
        args = (raw, self.content_format, self.image_placeholder, self.media_sources)
        turns, images = await self._checked(chat_inputs, "messages", *args)
        ids = await self.prompts.encode_chat(
            turns, add_generation_prompt, add_special_tokens, whole
        )
        return await self._with_images(ids, images, "messages")

    async def _with_images(
        self, ids: list[int], images: list[Any], field: str
    ) -> tuple[list[int], list[ImageInput]]:
        """A vision-language model's prompt with its images preprocessed and its placeholders
        expanded (a 400 naming `field` when they do not match); a text model's as it is."""
        if not self.takes_images:
            return ids, []
        data = {"image": images} if images else None
        return await self._checked(self.process_multimodal, field, ids, data)

    async def _checked(self, fn: Callable[..., T], field: str, *args: Any) -> T:
        """`fn(*args)` on a thread, its ValueError a 400 naming `field`."""
        try:
            return await self.prompts.parse(fn, *args)
        except ValueError as e:
            raise APIError(400, str(e), field) from None

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self.prompts.encode(prompt, "prompt")
        return prompt

    async def _prompt_text(self, given: str | list[int], ids: list[int]) -> str:
        if isinstance(given, str):
            return given
        return await self.prompts.decode(ids, "prompt", skip_special_tokens=False)

    async def _generate(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        echo: _Echo | None = None,
        images: list[list[ImageInput]] | None = None,
    ) -> Response:
        """Run the prompts, `n` choices each, and answer whole or as a stream; choice j of
        prompt i is index i * n + j, as vLLM numbers them."""
        chat = isinstance(body, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        reply = Reply(chat, request_id, self.settings.model_name, body.return_token_ids)
        with _engine_errors():
            if body.stop_strings:
                self.prompts.require_tokenizer("stop")
            self._check_num_choices(len(prompts) * body.n)
            requests = [
                EngineRequest(
                    prompt,
                    self._sampling_params(body, len(prompt), max_tokens),
                    i * body.n,
                    images[i] if images else [],
                )
                for i, prompt in enumerate(prompts)
            ]
            stream = self.engine.submit(request_id, requests)
            deltas = aiter(stream)
            # Streams wait for the first delta too, so a refusal is still a plain 4xx.
            work = anext(deltas) if body.stream else collect(deltas, stream.num_choices)
            result = await _unless_disconnected(request, work)
        if result is None:
            return Response(status_code=499)  # the client closed the connection
        choices = _Choices(reply, prompts, body.n, body.num_logprobs, echo, self.textless)
        if body.stream:
            events = _sse(choices, result, deltas, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        answer = [choices.chunk(delta, stream=False) for delta in result]
        return JSONResponse(reply.body(answer, stream=False, usage=choices.usage(result)))

    def _check_num_choices(self, num_choices: int) -> None:
        """A 400 for more choices than the server may ever hold at once (a 429 would say
        to retry, in vain)."""
        limit = self.settings.max_pending_requests
        if num_choices > limit:
            raise APIError(
                400,
                f"n: this request asks for {num_choices} choices (prompts times n), more than "
                f"the {limit} that --max-pending-requests={limit} allows",
                "n",
            )

    def _sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        num_prompt_tokens: int,
        max_tokens: int | None,
    ) -> SamplingParams:
        """SamplingParams within the room the context leaves (None: all of it, but for
        completions OpenAI's default of 16, cut to the room)."""
        completion = isinstance(body, CompletionRequest)
        check_prompt_length(
            num_prompt_tokens, self.max_model_len, "prompt" if completion else "messages"
        )
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None and completion:
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room)
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"max_tokens={max_tokens} is more than the {room} tokens left: max_model_len="
                f"{self.max_model_len} minus the prompt's {num_prompt_tokens}",
                "max_tokens",
            )
        return SamplingParams(
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.logit_bias,
            max_tokens=max_tokens or room,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=body.stop_strings,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            logprobs=body.num_logprobs,
            prompt_logprobs=body.num_prompt_logprobs,
        )

    def _check_model(self, model: str | None) -> None:
        """A 404 for another model's name (None: /tokenize and /detokenize may omit it)."""
        if model is not None and model != self.settings.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                "model",
            )

    async def _parse(self, request: Request, model: type[T]) -> T:
        """The JSON body as `model`, parsed off the event loop."""
        return await self.prompts.parse(parse_request, model, await self._read_body(request))

    async def _read_body(self, request: Request) -> bytes:
        """The body of a JSON request, refused (413) as soon as it grows past the limit.
        Only JSON is taken (415 else): a browser sends text/plain across origins without
        asking first (a CORS "simple request"), JSON only after a preflight."""
        _check_json(request.headers.get("content-type"))
        limit = self.settings.max_request_bytes
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    message = f"the request body is over {limit} bytes (--max-request-bytes)"
                    raise APIError(413, message)
        except ClientDisconnect:  # gone, or dropped by --request-read-timeout
            raise APIError(400, "the client went away before sending the whole body") from None
        return bytes(body)


def _check_json(content_type: str | None) -> None:
    media_type, *params = (part.strip().lower() for part in (content_type or "").split(";"))
    charset_ok = all(p.replace(" ", "") in ("charset=utf-8", "charset=utf8") for p in params)
    if media_type != "application/json" or not charset_ok:
        raise APIError(
            415,
            f"Content-Type must be application/json (UTF-8); got {content_type!r}",
            "Content-Type",
        )


def _query(request: Request, name: str, kind: Kind, default: object) -> object:
    """Query parameter `name` as `kind` allows it (absent: `default`); else a 400 naming it."""
    text = request.query_params.get(name)
    return default if text is None else _check_query(name, kind, kind.parse(text))


def _check_query(name: str, kind: Kind, value: object) -> object:
    try:
        return kind.check(name, value)
    except ValueError as e:
        raise APIError(400, str(e), name) from None


@contextmanager
def _engine_errors() -> Iterator[None]:
    """The engine's refusals and failures as HTTP errors (see `_as_api_error`)."""
    try:
        yield
    except (ValueError, QueueFullError, *_FAILURES) as e:
        raise _as_api_error(e) from None


_FAILURES = (RequestFailedError, EngineDeadError, ServerStoppingError, EngineStateError)


def _as_api_error(error: Exception) -> APIError:
    """Bad input 400, a call the engine's state refuses 409, full 429, a failed step 500,
    engine dead, asleep or server stopping 503."""
    status = 500 if isinstance(error, RequestFailedError) else 503
    if isinstance(error, ValueError):
        status = 400
    elif isinstance(error, EngineStateError) and not isinstance(error, EngineAsleepError):
        status = 409
    elif isinstance(error, QueueFullError):
        status = 429
    return APIError(status, str(error))


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, or cancel it when the client goes away, which aborts its request
    and frees its blocks; None then."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # nothing when it is done
    return task.result() if task.done() else None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Echo:
    """What completions' `echo` puts before each prompt's choices: the prompt's text, and
    with logprobs the text of its first token (which has no logprob)."""

    texts: list[str]
    first_tokens: list[str] | None


class _Choices:
    """The choices of one response as its chunks show them: a choice's first chunk adds
    the echoed prompt, the prompt's ids and the chat role; in a stream, a delta with no
    text waits (its tokens joining the next) unless it ends its choice, so that no chunk
    is empty. A model without a tokenizer (`textless`) has only token ids to show: each
    delta with new ones is a chunk."""

    def __init__(
        self,
        reply: Reply,
        prompts: list[list[int]],
        n: int,
        num_logprobs: int | None,
        echo: _Echo | None,
        textless: bool = False,
    ) -> None:
        self.reply = reply
        self.textless = textless
        self.prompts = prompts
        self.n = n
        self.num_logprobs = num_logprobs
        self.echo = echo
        self._last: dict[int, Delta] = {}  # each choice's latest delta shown
        self._num_chars: dict[int, int] = {}  # each choice's text shown so far
        self._held: dict[int, Delta] = {}  # each choice's deltas not shown yet, as one

    def chunk(self, delta: Delta, stream: bool) -> dict[str, Any]:
        """The choice object of `delta` (of the whole choice, when not streaming)."""
        first = delta.index not in self._last
        self._last[delta.index] = delta
        prompt = delta.index // self.n
        text = delta.text
        positions = (
            None
            if delta.logprobs is None
            else list(zip(delta.token_ids, delta.logprobs, strict=True))
        )
        if first and self.echo is not None:
            text = self.echo.texts[prompt] + text
            if positions is not None:
                positions = [
                    *zip(self.prompts[prompt], delta.prompt_logprobs, strict=True),
                    *positions,
                ]
        offset = self._num_chars.get(delta.index, 0)
        self._num_chars[delta.index] = offset + len(text)
        return self.reply.choice(
            delta.index,
            text,
            delta.finish_reason,
            stream=stream,
            token_ids=delta.token_ids,
            prompt_token_ids=self.prompts[prompt],
            first=first,
            logprobs=None if positions is None else self._logprobs(positions, offset, prompt),
            stop_reason=delta.stop_reason,
        )

    def merge(self, delta: Delta) -> Delta | None:
        """`delta` joined to what its choice held, or None when that is still nothing to
        show (no text, no end, no echo to send first)."""
        held = self._held.pop(delta.index, None)
        if held is not None:
            delta = held.then(delta)
        echo = self.echo is not None and delta.index not in self._last
        shown = delta.text or (self.textless and delta.token_ids)
        if shown or delta.finish_reason is not None or echo:
            return delta
        self._held[delta.index] = delta
        return None

    def usage(self, last: list[Delta] | None = None) -> dict[str, int]:
        """The usage of every prompt (once, whatever n) and every choice's tokens."""
        last = list(self._last.values()) if last is None else last
        return usage(sum(map(len, self.prompts)), sum(d.num_output_tokens for d in last))

    def _logprobs(self, positions: list[Position], offset: int, prompt: int) -> dict[str, Any]:
        if self.reply.chat:
            return chat_logprobs(positions, self.num_logprobs or 0)
        first = (
            ""
            if self.echo is None or self.echo.first_tokens is None
            else self.echo.first_tokens[prompt]
        )
        return completion_logprobs(positions, offset, first)


async def _sse(
    choices: _Choices,
    delta: Delta | None,
    rest: AsyncGenerator[Delta, None],
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta worth one, the usage if asked, then [DONE]."""
    reply = choices.reply
    try:
        while delta is not None:
            shown = choices.merge(delta)
            if shown is not None:
                yield _event(reply.body([choices.chunk(shown, stream=True)], stream=True))
            delta = await anext(rest, None)
    except _FAILURES as e:  # the last chunk says why the stream ends here
        yield _event(_as_api_error(e).body())
        return
    finally:
        await rest.aclose()  # a client gone mid-stream: abort and free its blocks now
    if include_usage:
        yield _event(reply.body([], stream=True, usage=choices.usage()))
    yield "data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    if error.status >= 500 or error.status == 429:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, error.status, error)
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Routing errors (404, 405) in the same error shape as the rest."""
    message = f"{error.detail}: {request.method} {request.url.path}"
    return await _api_error(request, APIError(error.status_code, message))
