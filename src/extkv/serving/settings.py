"""What `extkv serve` adds to the engine options, declared once (see `extkv.options`).

Kept apart from the app so that the command line can build its flags without
importing the web stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from extkv.options import File, Float, Int, Text, Texts, check_options, option, required


@dataclass
class ServerSettings:
    """What `extkv serve` adds to the engine options (its flags are generated from these)."""

    model_name: str = required(
        "the model name clients ask for (default: --model)", Text(), flag="--served-model-name"
    )
    host: str = option("127.0.0.1", "address to bind; 0.0.0.0: every interface", Text())
    port: int = option(8000, "port to bind", Int(1, 65535))
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on /v1 (None: $EXTKV_API_KEY, else open)",
        Text(optional=True),
    )
    max_pending_requests: int = option(
        1024, "requests held at once, running or queued; beyond it: 429", Int(1)
    )
    max_request_bytes: int = option(4 << 20, "largest request body; beyond it: 413", Int(1))
    request_read_timeout: float = option(
        30.0,
        "seconds a client has to send a whole request (headers and body); then it is dropped",
        Float(0, above_minimum=True),
    )
    max_connections: int = option(
        2048, "connections open at once; beyond it each new one gets a 503", Int(1)
    )
    shutdown_timeout: float = option(
        10.0,
        "on SIGTERM/SIGINT, seconds running requests may finish in before they are aborted",
        Float(0),
    )
    allowed_origins: tuple[str, ...] = option(
        (),
        "browser origins allowed to call the API (CORS), e.g. https://app.example; "
        "repeatable; none: CORS off",
        Texts(),
    )

    chat_template: str | None = option(
        None,
        "a Jinja chat template file for chat completions and /tokenize messages, in place "
        "of the model's own (None: the model's)",
        File(optional=True),
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.chat_template is not None:
            self.chat_template_text()  # a broken template fails now, not at the first chat

    def chat_template_text(self) -> str | None:
        """The --chat-template file's text, refused (ValueError) unless it is valid Jinja."""
        if self.chat_template is None:
            return None
        from jinja2 import Environment, TemplateSyntaxError

        where = f"--chat-template {self.chat_template!r}"
        try:
            with open(self.chat_template, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise ValueError(f"{where} is not UTF-8 text") from None
        try:
            Environment().parse(text)
        except TemplateSyntaxError as e:
            message = f"{where} is not a valid Jinja template: {e.message} (line {e.lineno})"
            raise ValueError(message) from None
        return text
