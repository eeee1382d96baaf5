"""Prompt text to token ids, away from the event loop.

Tokenizing a prompt of megabytes takes seconds. On the event loop it would stall
every other request, `/health` included; on a thread it still would, for the
tokenizer holds the GIL for long stretches (about 0.15 s a megabyte, measured). So
chat templating and tokenization run in worker processes, each with its own
tokenizer, and a prompt longer than the limit comes back as its token count only,
never as millions of ids. Parsing JSON bodies (milliseconds) runs on a thread.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from jinja2 import TemplateError

from extkv.serving.protocol import APIError, check_prompt_length

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
MAX_PROCESSES = 4


class PromptEncoder:
    """The handlers' CPU work: `parse` on a thread, `encode` and `encode_chat` in the
    worker processes. `tokenizer` None: the model takes token ids only."""

    def __init__(
        self,
        tokenizer: Any | None,
        model_name: str,
        max_model_len: int,
        chat_template: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._has_tokenizer = tokenizer is not None
        self._vocab_size = 0 if tokenizer is None else len(tokenizer)
        self._chat_template = chat_template  # None: the tokenizer's own
        own = getattr(tokenizer, "chat_template", None)
        self._has_chat_template = chat_template is not None or own is not None
        self._tokenizer = tokenizer
        self._threads = ThreadPoolExecutor(4, thread_name_prefix="extkv-parse")
        self._processes = None if tokenizer is None else self._new_processes()

    async def start(self) -> None:
        """Start the worker processes now rather than on the first text prompt."""
        if self._processes is not None:
            await asyncio.wrap_future(self._processes.submit(_ready))

    async def parse(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a thread."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def encode(
        self, text: str, field: str, add_special_tokens: bool = True, whole: bool = False
    ) -> list[int]:
        """The ids of a completion prompt (special tokens added as the model wants). A prompt
        that leaves no room to generate is a 400, unless `whole` (for /tokenize)."""
        self.require_tokenizer(field)
        return await self._in_worker(_encode, field, whole, text, add_special_tokens)

    async def encode_chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        whole: bool = False,
    ) -> list[int]:
        """The ids of the chat template applied to `messages` (ready for the answer when
        `add_generation_prompt`); `whole` as in `encode`."""
        self.require_tokenizer("messages")
        if not self._has_chat_template:
            raise APIError(
                400,
                f"model {self.model_name!r} has no chat template (none in its "
                "tokenizer_config.json); use /v1/completions with a prompt instead",
                "messages",
            )
        try:
            args = (messages, add_generation_prompt, add_special_tokens)
            return await self._in_worker(_encode_chat, "messages", whole, *args)
        except TemplateError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e

    async def decode(self, token_ids: list[int], field: str, skip_special_tokens: bool) -> str:
        """The text of `token_ids`, each checked against the vocabulary (a 400 naming
        `field` for one outside it)."""
        self.require_tokenizer(field)
        bad = next((t for t in token_ids if t >= self._vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"{field}: token id {bad} is outside the vocabulary of {self._vocab_size} "
                f"tokens (ids 0 to {self._vocab_size - 1})",
                field,
            )
        return await self._in_worker(_decode, field, True, token_ids, skip_special_tokens)

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's own string in the vocabulary (byte-level marks and all)."""
        return await self._in_worker(_token_strs, "tokens", True, token_ids)

    def require_tokenizer(self, field: str) -> None:
        """A 400 naming `field` for text (a prompt, messages, stop strings) sent to a model
        without a tokenizer."""
        if not self._has_tokenizer:
            raise APIError(
                400,
                f"{field}: model {self.model_name!r} has no tokenizer, so it takes no "
                "text; send the prompt as a list of token ids and no stop strings",
                field,
            )

    def close(self) -> None:
        """Cancel queued work, stop the threads, and end and reap the worker processes
        (a worker busy with a long prompt is not waited for; none is left behind)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is None:
            return
        # The executor's own Process objects: `terminate_workers()` is public only from
        # Python 3.14, and shutdown(wait=False) alone leaves the workers unreaped.
        workers = list((getattr(self._processes, "_processes", None) or {}).values())
        self._processes.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join(timeout=10)

    def _new_processes(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max(1, min(MAX_PROCESSES, (os.cpu_count() or 1) // 2)),
            mp_context=multiprocessing.get_context("spawn"),  # no copy of the engine
            initializer=_start_worker,
            initargs=(self._tokenizer, self._chat_template),
        )

    async def _in_worker(
        self, fn: Callable[..., R | int], field: str, whole: bool, *args: Any
    ) -> R:
        """`fn(limit, *args)` in a worker; `limit` None when `whole`, else max_model_len: a
        result that long comes back as its length only, turned here into the 400."""
        assert self._processes is not None
        pool = self._processes
        limit = None if whole else self.max_model_len
        try:
            ids = await asyncio.wrap_future(pool.submit(fn, limit, *args))
        except BrokenProcessPool:  # a worker was killed (the OOM killer?): start afresh
            if self._processes is pool:
                logger.error("A tokenizer process died; starting new ones.")
                self._processes = self._new_processes()
            raise APIError(503, "the tokenizer process died; retry") from None
        if isinstance(ids, int):  # too long: only its length came back
            check_prompt_length(ids, self.max_model_len, field)
        return ids


# --- in the worker processes -----------------------------------------------------------

_tokenizer: Any = None
_chat_template: str | None = None


def _start_worker(tokenizer: Any, chat_template: str | None) -> None:
    global _tokenizer, _chat_template
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server to handle
    _tokenizer, _chat_template = tokenizer, chat_template
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # as transformers' encode: every token, no padding
        backend.no_truncation()
        backend.no_padding()


def _ready() -> None:
    pass


def _encode(limit: int | None, text: str, add_special_tokens: bool) -> list[int] | int:
    """The ids, or only their number when there are `limit` or more (none: all of them)."""
    backend = getattr(_tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer
        ids = _tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        ids = backend.encode(text, add_special_tokens=add_special_tokens)
    if limit is not None and len(ids) >= limit:
        return len(ids)
    return list(getattr(ids, "ids", ids))


def _encode_chat(
    limit: int | None,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> list[int] | int:
    text = _tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=_chat_template,
    )
    return _encode(limit, text, add_special_tokens)  # the template has the special tokens


def _decode(limit: None, token_ids: list[int], skip_special_tokens: bool) -> str:
    return _tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def _token_strs(limit: None, token_ids: list[int]) -> list[str]:
    return _tokenizer.convert_ids_to_tokens(token_ids)
