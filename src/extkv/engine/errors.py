"""The engine's own errors: what a caller can catch and tell a user in one line."""

from __future__ import annotations

import torch


class StartupError(RuntimeError):
    """The engine cannot start as configured (e.g. the KV cache does not fit); the message
    gives the figures and the options that would fix it."""


class RequestFailedError(RuntimeError):
    """A request failed while the engine stepped it (the other requests carry on)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id


class EngineStateError(RuntimeError):
    """The engine cannot do what was asked in the state it is in (requests in flight, asleep,
    a KV cache allocated whole); the message says what would allow it."""


class EngineAsleepError(EngineStateError):
    """The engine is asleep (`LLM.sleep`): it takes no request until `wake_up`."""


class EngineDeadError(RuntimeError):
    """The engine hit an error it cannot recover from (the device, or a tensor-parallel
    worker, is gone); it serves no further request. A server should exit and be
    restarted."""


def is_fatal(error: BaseException) -> bool:
    """Whether `error` leaves the engine unusable: a device error (CUDA's are sticky: every
    later call fails too) or a lost tensor-parallel worker, as opposed to an error that
    only the requests of one step met (e.g. out of memory for one large prefill)."""
    from extkv.engine.workers import WorkerError

    if isinstance(error, torch.OutOfMemoryError):
        return False
    return isinstance(error, torch.AcceleratorError | WorkerError | EngineDeadError)
