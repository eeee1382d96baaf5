"""Text from a growing list of tokens, decoded as it grows, with stop strings."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Incremental detokenization of one request.

    Each step decodes only a short window (the previous step's tokens as context,
    then the new ones), so a step costs O(1) however long the output grows, and a
    UTF-8 character split over byte-level tokens waits until it is whole. With stop
    strings, the last `holdback` (`len(longest stop) - 1`) characters may still begin a
    match: streamed text stops short of them, so it never shows part of a stop string.
    """

    def __init__(
        self,
        tokenizer: Any | None,
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer  # None: the model has no tokenizer, so no text
        self.stop = stop
        self.include_stop = include_stop  # keep the stop string that ended the text
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max(map(len, stop), default=1) - 1
        self.text = ""  # decoded so far, up to a stop string if one was hit
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._token_ids: list[int] = []
        self._prefix = 0  # window start: the context tokens
        self._read = 0  # tokens already turned into text

    @property
    def num_safe_chars(self) -> int:
        """How much of `text` can no longer begin a stop string: what may be streamed
        while more tokens can come."""
        return max(len(self.text) - self.holdback, 0)

    def add(self, token_ids: list[int], finished: bool, search: bool = True) -> None:
        """Take a step's new tokens (`finished`: the last ones, so an incomplete character
        is decoded as it is). `search` off: the new text is not searched for stop strings
        (before min_tokens)."""
        self._token_ids += token_ids
        start = self.num_safe_chars  # where a new match can begin
        self.text += self._decode_new(flush=finished)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits and search:
            at, stop = min(hits)
            self.text = self.text[: at + len(stop) if self.include_stop else at]
            self.stopped = True
            self.stop_reason = stop

    def _decode_new(self, flush: bool) -> str:
        if self.tokenizer is None:
            return ""
        ids = self._token_ids
        context = self._decode(ids[self._prefix : self._read])
        window = self._decode(ids[self._prefix :])
        if len(window) <= len(context) or (window.endswith("\ufffd") and not flush):
            return ""  # nothing new, or a character still incomplete
        self._prefix, self._read = self._read, len(ids)
        return window[len(context) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
