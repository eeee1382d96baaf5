"""What protects the server from its clients before a handler runs.

At the connection (`GuardedH11Protocol`, uvicorn's h11 protocol plus two rules): a
client must send each whole request, headers and body, within the read timeout, or
it is dropped (a client trickling bytes would otherwise hold a connection forever);
and past `max_connections` open connections a new one gets a 503 instead of service.
At the request (`LoopbackHostGuard`): a server bound to loopback answers only to
loopback host names, so a web page whose domain was rebound to 127.0.0.1 (DNS
rebinding) cannot use it from the victim's browser.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from extkv.serving.protocol import APIError

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is loopback."""
    host = host.lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a Host header, without the port: `[::1]:8000` -> `[::1]`."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.partition(":")[0]


async def send_error(send: Send, error: APIError, close: bool = False) -> None:
    """`error` as a whole JSON response, for guards that answer before any handler."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LoopbackHostGuard:
    """ASGI middleware: 403 for a request whose Host header is not a loopback name."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host")  # HTTP/1.0 may send none
            if host is not None and not is_loopback(_host_name(host.decode("latin-1"))):
                message = (
                    f"Host {host.decode('latin-1')!r} is not a loopback name; this server is "
                    "bound to loopback and answers to localhost, 127.0.0.1 or [::1] only"
                )
                await send_error(send, APIError(403, message))
                return
        await self.app(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on reading each request and a cap on
    open connections. Build it with `functools.partial(GuardedH11Protocol,
    read_timeout=..., max_connections=...)` as uvicorn's `http` protocol class."""

    def __init__(self, *args: Any, read_timeout: float, max_connections: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Refuse service past `max_connections` (a 503, then close) and start the first
        request's read deadline."""
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # this one included
            logger.warning("Refusing a connection: %d are open.", len(self.connections) - 1)
            self.app = self._over_capacity  # answers this connection's request, then closes
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Feed the bytes to h11, and lift the deadline once the whole request is in."""
        super().data_received(data)
        self._disarm_once_read()

    def on_response_complete(self) -> None:
        """Arm the deadline for the next request on this connection (lifted at once if it is
        already in, pipelined)."""
        self._arm()  # for the next request on this connection
        super().on_response_complete()
        self._disarm_once_read()  # it may have been pipelined already

    def connection_lost(self, exc: Exception | None) -> None:
        """Cancel the deadline, so that it never fires on a closed connection."""
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout, self._drop)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _disarm_once_read(self) -> None:
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self._disarm()  # the whole request is in: the response may take its time

    def _drop(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            logger.warning(
                "Dropping %s: no whole request within %g s (--request-read-timeout).",
                self.client or "a client",
                self.read_timeout,
            )
            self.transport.close()

    async def _over_capacity(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the server has {self.max_connections} connections open, the most that "
            f"--max-connections={self.max_connections} allows; retry later"
        )
        await send_error(send, APIError(503, message), close=True)
