"""The engine's own errors: what a caller can catch and tell a user in one line."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The engine cannot start as configured (e.g. the KV cache does not fit); the message
    gives the figures and the options that would fix it."""
