"""Heartbeats: how the driver tells a hung worker process from a busy one.

A worker that dies closes its sockets, and its collectives fail; a worker
that hangs (stopped, deadlocked, its host frozen) keeps them open, and a
collective waiting on it waits for the collective timeout. So every worker
beats on a pipe from a thread of its own, whatever its main thread is doing:
a long step, a slow load, a wait in a collective all leave the thread free
(torch's ops release the GIL), while a stopped or hung process sends nothing.
The driver notes when it last heard each pipe and calls a worker silent for
longer than its timeout hung.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

LONGEST_WAIT = 60.0  # seconds one wait may take (selectors overflow past ~24 days)


def beat_interval(timeout: float) -> float:
    """Seconds between beats: about one a second, and four within any timeout."""
    return min(1.0, timeout / 4)


def start_beating(pipe: Connection, interval: float) -> None:
    """In a worker: beat on `pipe` every `interval` seconds from a daemon thread. When
    the pipe breaks the driver is gone, so the worker exits at once: its main thread
    may wait in a collective that nothing will ever complete."""

    def beat() -> None:
        while True:
            try:
                pipe.send_bytes(b"")
            except OSError:
                logger.error("The tensor-parallel driver is gone; this worker exits.")
                os._exit(1)
            time.sleep(interval)

    threading.Thread(target=beat, name="extkv-heartbeat", daemon=True).start()


class HeartbeatMonitor:
    """The driver's side: when each worker's pipe was last heard, and which worker has
    been silent for longer than `timeout` seconds."""

    def __init__(self, pipes: list[Connection], timeout: float) -> None:
        self.timeout = timeout
        self._open = {pipe: index for index, pipe in enumerate(pipes)}
        self._pipes = pipes
        self._last = [time.monotonic()] * len(pipes)

    @property
    def pipes(self) -> list[Connection]:
        """The pipes still open, to wait on."""
        return list(self._open)

    def listen(self) -> None:
        """Take every beat waiting in the pipes. A closed pipe is heard no more (its
        worker exited, which the driver learns from the process itself)."""
        now = time.monotonic()
        for pipe, index in list(self._open.items()):
            try:
                while pipe.poll():
                    pipe.recv_bytes()
                    self._last[index] = now
            except (EOFError, OSError):
                del self._open[pipe]

    def overdue(self) -> tuple[int, float] | None:
        """(index, seconds silent) of the first worker silent past the timeout, if any."""
        now = time.monotonic()
        for index, last in enumerate(self._last):
            if now - last >= self.timeout:
                return index, now - last
        return None

    def seconds_left(self) -> float:
        """How long until the next worker would be overdue (the longest wait to make)."""
        return min(max(min(self._last) + self.timeout - time.monotonic(), 0.0), LONGEST_WAIT)

    def close(self) -> None:
        """Close the pipes (the workers have exited)."""
        for pipe in self._pipes:
            pipe.close()
