"""The OpenAI-compatible HTTP server: routes, API key, size limits, streaming.

Handlers parse and check a request, turn it into prompt token ids and
SamplingParams, and hand it to the `AsyncEngine`; they wait for its deltas while
watching the connection, so a client that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from extkv.engine.llm_engine import LLMEngine
from extkv.engine.sampling_params import SamplingParams
from extkv.serving.async_engine import AsyncEngine, Delta, EngineDeadError, QueueFullError, collect
from extkv.serving.metrics import ServerMetrics
from extkv.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Reply,
    parse_request,
    usage,
)
from extkv.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The ASGI app; it starts the engine thread on startup and stops it on shutdown."""
    server = _Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await server.engine.stop()

    app = FastAPI(title="extkv", lifespan=lifespan)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.check_api_key)])
    v1.post("/completions")(server.completions)
    v1.post("/chat/completions")(server.chat_completions)
    v1.get("/models")(server.models)
    app.include_router(v1)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    return app


def run_server(engine: LLMEngine, settings: ServerSettings, log_level: str = "info") -> None:
    host, port = settings.host, settings.port
    if host not in LOOPBACK and settings.api_key is None:
        logger.warning("Serving on %s without --api-key: whoever reaches it can use it.", host)
    logger.info("Serving %s on http://%s:%d/v1", settings.model_name, host, port)
    app = build_app(engine, settings)
    uvicorn.run(app, host=host, port=port, log_config=None, log_level=log_level.lower())


class _Server:
    def __init__(self, engine: LLMEngine, settings: ServerSettings) -> None:
        self.settings = settings
        self._metrics = ServerMetrics()
        self.engine = AsyncEngine(engine, self._metrics, settings.max_pending_requests)
        # The engine thread decodes with engine.tokenizer; handlers encode with a copy,
        # since one Rust tokenizer used from two threads at once can fail ("Already borrowed").
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len = engine.config.max_model_len
        self.created = int(time.time())

    async def check_api_key(self, request: Request) -> None:
        if self.settings.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.settings.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")

    async def completions(self, request: Request) -> Response:
        body = parse_request(CompletionRequest, await self._read_body(request))
        self._check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompt = self._require_tokenizer("prompt").encode(prompt)
        max_tokens = body.max_tokens
        if max_tokens is None:  # OpenAI's default, cut to the room the prompt leaves
            room = self.max_model_len - len(prompt)
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max(room, 1))
        return await self._generate(request, body, prompt, max_tokens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await self._read_body(request))
        self._check_model(body.model)
        prompt = self._apply_chat_template(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(request, body, prompt, max_tokens, chat=True)

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

    async def _generate(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: list[int],
        max_tokens: int | None,
        chat: bool,
    ) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        reply = Reply(chat, request_id, self.settings.model_name, body.return_token_ids)
        with _engine_errors():
            params = self._sampling_params(body, len(prompt), max_tokens, chat)
            if body.stop_strings:
                self._require_tokenizer("stop")
            deltas = aiter(self.engine.submit(request_id, prompt, params, body.stop_strings))
            # Streams wait for the first delta too, so a refusal is still a plain 4xx.
            work = anext(deltas) if body.stream else collect(deltas)
            result = await _unless_disconnected(request, work)
        if result is None:
            return Response(status_code=499)  # the client closed the connection
        if body.stream:
            events = _sse(reply, result, deltas, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        choice = reply.choice(result.text, result.token_ids, result.finish_reason, stream=False)
        counts = usage(result.num_prompt_tokens, result.num_output_tokens)
        return JSONResponse(reply.body([choice], stream=False, usage=counts))

    def _sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        num_prompt_tokens: int,
        max_tokens: int | None,
        chat: bool,
    ) -> SamplingParams:
        """SamplingParams within the room the context leaves (None: all of it)."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {num_prompt_tokens} tokens, but max_model_len="
                f"{self.max_model_len} allows at most {self.max_model_len - 1}",
                "messages" if chat else "prompt",
            )
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"max_tokens={max_tokens} is more than the {room} tokens left: max_model_len="
                f"{self.max_model_len} minus the prompt's {num_prompt_tokens}",
                "max_tokens",
            )
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=max_tokens or room,
            seed=body.seed,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
        )

    def _apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        tokenizer = self._require_tokenizer("messages")
        if tokenizer.chat_template is None:
            raise APIError(
                400,
                f"model {self.settings.model_name!r} has no chat template (none in its "
                "tokenizer_config.json); use /v1/completions with a prompt instead",
                "messages",
            )
        try:
            text = tokenizer.apply_chat_template(
                [m.as_dict() for m in messages], tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e
        return tokenizer.encode(text, add_special_tokens=False)  # the template has them

    def _require_tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise APIError(
                400,
                f"{field}: model {self.settings.model_name!r} has no tokenizer, so it takes no "
                "text; send the prompt as a list of token ids and no stop strings",
                field,
            )
        return self.tokenizer

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                "model",
            )

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it grows past the limit."""
        limit = self.settings.max_request_bytes
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the request body is over {limit} bytes (--max-request-bytes)")
        return bytes(body)


@contextmanager
def _engine_errors() -> Iterator[None]:
    """The engine's refusals as HTTP errors: bad input 400, full 429, down 503."""
    try:
        yield
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except QueueFullError as e:
        raise APIError(429, str(e)) from None
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None


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


async def _sse(
    reply: Reply, delta: Delta, rest: AsyncGenerator[Delta, None], include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta, the usage if asked, then [DONE]."""
    first = True
    try:
        while True:
            choice = reply.choice(
                delta.text, delta.token_ids, delta.finish_reason, stream=True, first=first
            )
            yield _event(reply.body([choice], stream=True))
            if delta.finish_reason is not None:
                break
            delta, first = await anext(rest), False
    except EngineDeadError as e:
        yield _event(APIError(503, str(e)).body())
        return
    finally:
        await rest.aclose()  # a client gone mid-stream: abort and free its blocks now
    if include_usage:
        counts = usage(delta.num_prompt_tokens, delta.num_output_tokens)
        yield _event(reply.body([], stream=True, usage=counts))
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
