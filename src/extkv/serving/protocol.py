"""The OpenAI wire format: request models that refuse bad input with a message naming
the field, and the response and stream-chunk objects of both endpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from extkv.engine.outputs import Logprob
from extkv.engine.sampling_params import MAX_LOGPROBS

T = TypeVar("T", bound=BaseModel)
# vLLM's error types: the openai client's exception names for the status.
_ERROR_TYPES = {
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the client caused (or must wait out), sent as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's error object: its `type` follows the status (other 4xx: BadRequestError,
        other 5xx: InternalServerError), its `code` is the status."""
        default = "InternalServerError" if self.status >= 500 else "BadRequestError"
        kind = _ERROR_TYPES.get(self.status, default)
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.status}
        return {"error": error}


def _one_of(allowed: str) -> WrapValidator:
    """Replace a union's per-branch errors by one message saying what is allowed."""

    def validate(value: object, handler: ValidatorFunctionWrapHandler) -> object:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", "must be " + allowed) from None

    return WrapValidator(validate)


TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
TokenIds = list[TokenId]
Prompt = Annotated[
    str | TokenIds | Annotated[list[str], Field(min_length=1)] | list[TokenIds],
    _one_of("a string, a list of strings, a list of token ids (ints >= 0) or a list of such lists"),
]
Stop = Annotated[
    StopString | list[StopString], _one_of("a non-empty string or a list of non-empty strings")
]


Number = Annotated[float, Field(allow_inf_nan=False)]


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias, token ids as JSON's string keys, as SamplingParams takes it:
    int keys, each bias clamped to OpenAI's [-100, 100] as vLLM does."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise PydanticCustomError(
                "invalid_value",
                'keys must be token ids written as strings of digits (e.g. "50256"); got {key}',
                {"key": repr(key[:30])},
            )
        out[int(key)] = min(max(value, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return out


LOGIT_BIAS_LIMIT = 100.0
LogitBias = Annotated[dict[str, Number], AfterValidator(_token_id_keys)]


class _Strict(BaseModel):
    # strict: "1" is not a number and 1.5 not an int; forbid: a misspelt field is an error,
    # not a silently ignored option.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"temperature": null` (as clients send for "not set") is the field's default."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class StreamOptions(_Strict):
    """OpenAI's `stream_options`: `include_usage` adds a last chunk with the token counts."""

    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields both endpoints share; those after `user` are extensions in vLLM's style."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: Stop | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Number = Field(0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: Number = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "allowed only with stream=true")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """A /v1/completions body: the shared fields and a prompt (text or token ids), or a
    list of them: one choice each; `echo` puts the prompt's text before each choice's."""

    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated position (None: no logprobs)."""
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt position: echoed prompts show theirs."""
        return self.logprobs if self.echo else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each with its `n` choices (a single prompt is a list of one)."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TextPart(_Strict):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    """Where an image part's image is: a data: URL (or a file:// URL the server allows)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; every image is whole here


class ImageURLPart(_Strict):
    """An image part of a message's content, for a vision-language model."""

    type: Literal["image_url"]
    image_url: ImageURL


Content = Annotated[
    str | list[Annotated[TextPart | ImageURLPart, Field(discriminator="type")]],
    _one_of(
        'a string or a list of {"type": "text", "text": ...} and {"type": "image_url", '
        '"image_url": {"url": ...}} parts'
    ),
]


class ChatMessage(_Strict):
    """One chat turn; its content a string or a list of text and image parts."""

    role: Literal["system", "user", "assistant"]
    content: Content

    def as_dict(self) -> dict[str, Any]:
        """The message as plain data: content a string, or the parts as dicts (what
        extkv.engine.chat_content turns into the chat template's messages)."""
        content = self.content
        if not isinstance(content, str):
            content = [part.model_dump(exclude_none=True) for part in content]
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_GenerationRequest):
    """A /v1/chat/completions body; `max_completion_tokens`, OpenAI's newer name, wins over
    `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _only_with_logprobs(cls, value: int | None, info: ValidationInfo) -> Any:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "allowed only with logprobs=true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated position (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> None:
        """Chat never shows the prompt's logprobs."""
        return None


class TokenizeRequest(_Strict):
    """A /tokenize body: vLLM's two kinds, a `prompt` (special tokens added unless
    `add_special_tokens` is false) or chat `messages` (through the chat template, which
    adds the special tokens itself; `add_generation_prompt` as in chat completions)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            message = "send either prompt (a string) or messages (a list of messages), not both"
            raise PydanticCustomError("invalid_value", message)
        return self


class DetokenizeRequest(_Strict):
    """A /detokenize body: token ids to turn back into text."""

    model: str | None = None
    tokens: list[TokenId]


class KVCacheResizeRequest(_Strict):
    """A /kv_cache/resize body: the size to commit, as blocks or as bytes (rounded down to
    whole blocks and granules); exactly one of them."""

    num_blocks: int | None = Field(None, ge=1)
    memory_bytes: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _exactly_one(self) -> KVCacheResizeRequest:
        if (self.num_blocks is None) == (self.memory_bytes is None):
            raise PydanticCustomError(
                "invalid_value",
                "give exactly one of num_blocks (an int >= 1) or memory_bytes (an int >= 0)",
            )
        return self


def parse_request(model: type[T], body: bytes) -> T:
    """Validate a JSON body; every problem becomes one 400 naming its field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            where = ".".join(str(part) for part in error["loc"]) or "request body"
            message = error["msg"]
            if error["type"] == "extra_forbidden":
                message = f"unknown field; accepted fields: {', '.join(model.model_fields)}"
            problems.append(f"{where}: {message}")
        param = next((str(err["loc"][0]) for err in e.errors() if err["loc"]), None)
        raise APIError(400, "; ".join(problems), param) from None


def check_prompt_length(num_tokens: int, max_model_len: int, field: str) -> None:
    """A 400 naming the limit for a prompt that leaves no room to generate."""
    if num_tokens >= max_model_len:
        raise APIError(
            400,
            f"the prompt has {num_tokens} tokens, but max_model_len={max_model_len} allows "
            f"at most {max_model_len - 1}",
            field,
        )


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    """OpenAI's `usage` object of a request's token counts."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


# JSON has no -inf: vLLM sends this floor instead.
LOGPROB_FLOOR = -9999.0
# A position as the logprobs show it: its token and the candidates there (None: the
# first prompt token, which nothing comes before).
Position = tuple[int, dict[int, Logprob] | None]


def _ranked(candidates: dict[int, Logprob]) -> list[Logprob]:
    return sorted(candidates.values(), key=lambda lp: lp.rank)


def _floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(positions: list[Position], offset: int, first_text: str) -> dict[str, Any]:
    """vLLM's completions logprobs: each token's text and logprob, the candidates at its
    position (the chosen token and the top k, by rank), and where each token's text
    starts, counted from `offset`. `first_text`: the first prompt token's text."""
    out: dict[str, list[Any]] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    for token, candidates in positions:
        if candidates is None:
            text, logprob, top = first_text, None, None
        else:
            text = candidates[token].decoded_token or ""
            logprob = _floored(candidates[token].logprob)
            top = {lp.decoded_token or "": _floored(lp.logprob) for lp in _ranked(candidates)}
        out["text_offset"].append(offset)
        out["token_logprobs"].append(logprob)
        out["tokens"].append(text)
        out["top_logprobs"].append(top)
        offset += len(text)
    return out


def chat_logprobs(positions: list[Position], k: int) -> dict[str, Any]:
    """vLLM's (and OpenAI's) chat logprobs: per token its text, logprob and UTF-8 bytes,
    and the k most likely tokens at its position in the same shape."""
    content = [
        {
            **_chat_token(candidates[token]),
            "top_logprobs": [_chat_token(lp) for lp in _ranked(candidates)[:k]],
        }
        for token, candidates in positions
        if candidates is not None
    ]
    return {"content": content}


def _chat_token(logprob: Logprob) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    return {
        "token": text,
        "logprob": _floored(logprob.logprob),
        "bytes": list(text.encode("utf-8", errors="replace")),
    }


@dataclass
class Reply:
    """Builds the response objects of one request, for either endpoint, so that the
    handlers share one streaming and one non-streaming path."""

    chat: bool
    id: str
    model: str
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        *,
        stream: bool,
        token_ids: list[int],
        prompt_token_ids: list[int] | None = None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        """One choice: `text` for completions, a `message` for chat, a `delta` in chat chunks
        (the choice's first also names the role). With `return_token_ids`, its token ids,
        and the prompt's once: in the whole answer or the choice's first chunk."""
        out: dict[str, Any] = {"index": index}
        if not self.chat:
            out["text"] = text
        elif stream:
            out["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            out["message"] = {"role": "assistant", "content": text}
        out["logprobs"] = logprobs
        out["finish_reason"] = finish_reason
        out["stop_reason"] = stop_reason
        if self.return_token_ids:
            out["token_ids"] = token_ids
            if prompt_token_ids is not None and (first or not stream):
                out["prompt_token_ids"] = prompt_token_ids
        return out

    def body(
        self, choices: list[dict[str, Any]], *, stream: bool, usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        """The response or chunk object around `choices`, its `object` as the endpoint and
        streaming require."""
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        out = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out
