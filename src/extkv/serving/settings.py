"""What `extkv serve` adds to the engine options, declared once (see `extkv.options`).

Kept apart from the app so that the command line can build its flags without
importing the web stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from extkv.options import Int, Text, check_options, option, required


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

    def __post_init__(self) -> None:
        check_options(self)
