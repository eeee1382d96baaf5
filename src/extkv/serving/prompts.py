"""Prompt text to token ids, off the event loop.

Tokenizing a prompt of megabytes takes seconds; on the event loop it would stall
every other request, `/health` included. So handlers hand parsing, chat templating
and tokenization to a few threads, each with its own copy of the tokenizer (one Rust
tokenizer used by two threads at once can fail: "Already borrowed"). A prompt longer
than the limit is refused by its token count before its ids become Python objects:
building millions of ints holds the GIL, and so the loop, for a noticeable time.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from jinja2 import TemplateError

from extkv.serving.protocol import APIError, check_prompt_length

T = TypeVar("T")
NUM_THREADS = 4


class PromptEncoder:
    """Runs the handlers' CPU work on its threads; `tokenizer` None: the model takes
    token ids only."""

    def __init__(self, tokenizer: Any | None, model_name: str, max_model_len: int) -> None:
        # Copied once here, before the engine thread starts decoding with the original.
        self._tokenizer = copy.deepcopy(tokenizer)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._local = threading.local()
        self._copy_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="extkv-prompts")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on one of the threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, field: str) -> list[int]:
        """The ids of a completion prompt (special tokens added as the model wants)."""
        self.require_tokenizer(field)
        return await self.run(self._encode, text, True, field)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of the chat template applied to `messages`, ready for the answer."""
        if self.require_tokenizer("messages").chat_template is None:
            raise APIError(
                400,
                f"model {self.model_name!r} has no chat template (none in its "
                "tokenizer_config.json); use /v1/completions with a prompt instead",
                "messages",
            )
        return await self.run(self._encode_chat, messages)

    def require_tokenizer(self, field: str) -> Any:
        if self._tokenizer is None:
            raise APIError(
                400,
                f"{field}: model {self.model_name!r} has no tokenizer, so it takes no "
                "text; send the prompt as a list of token ids and no stop strings",
                field,
            )
        return self._tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- on the pool's threads ------------------------------------------------------

    def _thread_tokenizer(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._copy_lock:
                tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is not None:  # as transformers' encode: every token, no padding
                backend.no_truncation()
                backend.no_padding()
        return tokenizer

    def _encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        tokenizer = self._thread_tokenizer()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            check_prompt_length(len(ids), self.max_model_len, field)
            return ids
        encoding = backend.encode(text, add_special_tokens=add_special_tokens)  # GIL released
        check_prompt_length(len(encoding), self.max_model_len, field)
        return encoding.ids

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self._thread_tokenizer().apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from e
        return self._encode(text, False, "messages")  # the template has the special tokens
