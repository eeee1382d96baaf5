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
MAX_PROCESSES = 4


class PromptEncoder:
    """The handlers' CPU work: `parse` on a thread, `encode` and `encode_chat` in the
    worker processes. `tokenizer` None: the model takes token ids only."""

    def __init__(self, tokenizer: Any | None, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._has_tokenizer = tokenizer is not None
        self._has_chat_template = getattr(tokenizer, "chat_template", None) is not None
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

    async def encode(self, text: str, field: str) -> list[int]:
        """The ids of a completion prompt (special tokens added as the model wants)."""
        self.require_tokenizer(field)
        return await self._in_worker(_encode, field, text, True)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of the chat template applied to `messages`, ready for the answer."""
        self.require_tokenizer("messages")
        if not self._has_chat_template:
            raise APIError(
                400,
                f"model {self.model_name!r} has no chat template (none in its "
                "tokenizer_config.json); use /v1/completions with a prompt instead",
                "messages",
            )
        try:
            return await self._in_worker(_encode_chat, "messages", messages)
        except TemplateError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e

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
        """Stop the threads and worker processes without waiting, cancelling queued work."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.shutdown(wait=False, cancel_futures=True)

    def _new_processes(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max(1, min(MAX_PROCESSES, (os.cpu_count() or 1) // 2)),
            mp_context=multiprocessing.get_context("spawn"),  # no copy of the engine
            initializer=_start_worker,
            initargs=(self._tokenizer,),
        )

    async def _in_worker(
        self, fn: Callable[..., list[int] | int], field: str, *args: Any
    ) -> list[int]:
        assert self._processes is not None
        pool = self._processes
        try:
            ids = await asyncio.wrap_future(pool.submit(fn, self.max_model_len, *args))
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


def _start_worker(tokenizer: Any) -> None:
    global _tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server to handle
    _tokenizer = tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # as transformers' encode: every token, no padding
        backend.no_truncation()
        backend.no_padding()


def _ready() -> None:
    pass


def _encode(max_model_len: int, text: str, add_special_tokens: bool) -> list[int] | int:
    """The ids, or only their number when the prompt leaves no room to generate."""
    backend = getattr(_tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer
        ids = _tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        ids = backend.encode(text, add_special_tokens=add_special_tokens)
    return len(ids) if len(ids) >= max_model_len else list(getattr(ids, "ids", ids))


def _encode_chat(max_model_len: int, messages: list[dict[str, str]]) -> list[int] | int:
    text = _tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _encode(max_model_len, text, False)  # the template has the special tokens
