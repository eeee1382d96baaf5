"""Tensor-parallel worker processes, and how the driver keeps them in step.

Rank 0, the driver, is the user's process: it owns the scheduler, the block
manager and sampling. Ranks 1..N-1 are worker processes it spawns (or
torchrun's processes). Every rank loads its own shard and profiles, sizes and
captures on its own device (`start_rank`; the ranks agree on the smallest
block count). Then, every step, the driver broadcasts the step's inputs (token
ids, positions, slots, block tables: kilobytes, pickled over gloo), all ranks
run the forward pass, and the driver samples. Between steps it may broadcast a
`RankCall` instead: a resize, sleep, wake or weight load every rank applies to
its own memory (extkv.engine.rank_memory). None tells the workers to stop.

A worker that dies or fails makes the driver raise `WorkerError` and stop the
others. Before the process groups exist the driver polls its workers' exit
codes; after, a collective whose peer is gone fails (gloo at once, NCCL once
the watcher thread aborts it) and the driver names the worker that died.

A worker that hangs (e.g. SIGSTOPped) would leave the driver waiting in a
collective until the collective timeout, so spawned workers also beat on a
pipe (`extkv.distributed.heartbeat`); one silent for `worker_heartbeat_timeout`
seconds is killed by the watcher thread, which fails the collective, and the
driver names it as hung. Torchrun's processes are not ours to kill: there a
hang waits for the collective timeout (torchrun's own monitoring applies).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from extkv.distributed import (
    CommunicationError,
    HeartbeatMonitor,
    TPGroup,
    beat_interval,
    connect,
    start_beating,
)
from extkv.engine.config import EngineConfig
from extkv.engine.rank_memory import RankCall, RankMemory
from extkv.engine.startup import start_rank
from extkv.models import check_tensor_parallel

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # spawned workers live on this machine
START_TIMEOUT = datetime.timedelta(minutes=5)  # for every worker to come up
# One collective, e.g. the driver's first, which waits for the slowest rank's load.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for the next step
STOP_SECONDS = 10.0  # for a worker to exit once told to
EXIT_SECONDS = 5.0  # for a worker whose connection closed to be seen exiting
_STOPPED = "; the engine stopped its other workers and cannot run further steps"


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine stopped the others."""


def start_workers(config: EngineConfig) -> Workers:
    """The other ranks of a tensor-parallel engine, joined: spawned here, or torchrun's.
    Under torchrun, on ranks > 0 this serves rank 0 and exits the process when it closes."""
    check_tensor_parallel(config.model, config.tensor_parallel_size)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return _join_torchrun(config)
    return _spawn(config)


def serve(config: EngineConfig, group: TPGroup) -> None:
    """A worker rank's life: start up, then run every step the driver sends, and between
    steps every change to its memory (a `RankCall`), until None."""
    runner, cache, _, _ = start_rank(config, group)
    memory = RankMemory(runner, cache)
    try:
        while (message := group.broadcast_object(timeout=IDLE_TIMEOUT)) is not None:
            if isinstance(message, RankCall):
                message.run(memory)
            else:
                runner.forward(message)
    finally:
        runner.release()
        cache.free()


class Workers:
    """The driver's view of ranks 1..N-1: their process group, their processes and
    heartbeats (none under torchrun), noticing when one fails or hangs, stopping them."""

    def __init__(
        self,
        store: dist.Store,
        procs: list[mp.Process],
        heartbeats: HeartbeatMonitor | None = None,
    ) -> None:
        self.group: TPGroup | None = None
        self.error: WorkerError | None = None
        self._store = store
        self._procs = procs
        self._heartbeats = heartbeats
        self._culprit: mp.Process | None = None
        self._hang: str | None = None  # what the culprit did, when it hung rather than died
        self._stopped = False
        self._wake, self._waker = mp.Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch, name="extkv-tp-watch", daemon=True)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Around every use of the ranks: a failed collective becomes a WorkerError naming
        the worker at fault, and any error stops the workers (the ranks are out of step)."""
        if self._stopped:
            raise self.error or WorkerError("the tensor-parallel workers were stopped")
        try:
            yield
        except BaseException as e:
            self._fail(e)
            raise

    def stop(self, polite: bool = True) -> None:
        """Tell the workers to finish (they free their memory and exit), then make sure
        they did: terminated if they do not, or at once when not `polite`."""
        if self._stopped:
            return
        self._stopped = True
        self._waker.send(None)
        if polite and self.error is None and self.group is not None:
            try:
                self.group.broadcast_object(None)
            except CommunicationError:
                polite = False
        for proc in self._procs:
            proc.join(STOP_SECONDS if polite else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._heartbeats is not None:
            if self._watcher.is_alive():
                self._watcher.join()  # woken above: it reads the pipes no more
            self._heartbeats.close()  # only now: a worker whose pipe breaks exits at once

    def _wait_until_joined(self) -> None:
        """Every worker is about to join the process group; fail fast if one dies first."""
        keys = [f"joined/{rank}" for rank in range(1, len(self._procs) + 1)]
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while not self._store.check(keys):
            dead = wait([p.sentinel for p in self._procs], timeout=0.05)
            if dead:
                culprit = self._by_sentinel(dead[0])
                raise WorkerError(self._describe(culprit, " during start-up"))
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not start within {START_TIMEOUT}")

    def _watch(self) -> None:
        """Until `stop`: when a worker exits or misses its heartbeat, stop them all and
        unblock the driver. The driver's thread describes the culprit (that joins the
        process); here, only act, naming the culprit before its collective can fail."""
        sentinels = [p.sentinel for p in self._procs]
        beats = self._heartbeats
        while True:
            beats.listen()
            if silent := beats.overdue():
                index, seconds = silent
                self._hang = f"missed its heartbeat for {seconds:.1f} s (hung or stopped)"
                self._culprit = self._procs[index]
                logger.error(
                    "Tensor-parallel worker %s %s; killing it and stopping the others.",
                    self._culprit.name,
                    self._hang,
                )
                self._culprit.kill()  # SIGKILL: a stopped process takes no other signal
                break
            ready = wait([*sentinels, *beats.pipes, self._wake], beats.seconds_left())
            if self._wake in ready:
                return
            if dead := [s for s in ready if s in sentinels]:
                self._culprit = self._by_sentinel(dead[0])
                logger.error(
                    "Tensor-parallel worker %s exited; stopping the others.", self._culprit.name
                )
                break
        for proc in self._procs:
            proc.terminate()
        if self.group is not None:
            self.group.abort()

    def _fail(self, error: BaseException) -> None:
        """Stop the workers; raise WorkerError from `error` if one of them caused it."""
        culprit = None
        if isinstance(error, CommunicationError) and self._procs:
            dead = wait([p.sentinel for p in self._procs], timeout=EXIT_SECONDS)
            culprit = self._culprit or (self._by_sentinel(dead[0]) if dead else None)
        self.stop(polite=False)
        if culprit is not None:
            self.error = WorkerError(self._describe(culprit))
        elif isinstance(error, CommunicationError):
            self.error = WorkerError(f"a tensor-parallel rank stopped answering: {error}{_STOPPED}")
        if self.error is not None:
            raise self.error from error

    def _by_sentinel(self, sentinel: object) -> mp.Process:
        return next(p for p in self._procs if p.sentinel == sentinel)

    def _describe(self, proc: mp.Process, when: str = "") -> str:
        """What became of `proc`, with the traceback it left if it failed by itself."""
        proc.join()
        rank = self._procs.index(proc) + 1
        code = proc.exitcode
        if proc is self._culprit and self._hang is not None:
            how = f"{self._hang}, so the engine killed it"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited ({code})"
        text = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}{when}{_STOPPED}"
        key = f"error/{rank}"
        if self._store.check([key]):
            text += ". Its error:\n" + self._store.get(key).decode().rstrip()
        return text


def _spawn(config: EngineConfig) -> Workers:
    size = config.tensor_parallel_size
    store = dist.TCPStore(
        LOOPBACK, 0, size, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False
    )
    context = mp.get_context("spawn")
    # Workers log warnings and errors only: the driver logs what the ranks agreed on.
    level = max(logging.getLogger("extkv").getEffectiveLevel(), logging.WARNING)
    pipes = [context.Pipe(duplex=False) for _ in range(1, size)]  # (driver's, worker's)
    procs = [
        context.Process(
            target=_worker_main,
            args=(config.for_rank(rank), rank, store.port, level, pipes[rank - 1][1]),
            name=f"extkv-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    heartbeats = HeartbeatMonitor([heard for heard, _ in pipes], config.worker_heartbeat_timeout)
    workers = Workers(store, procs, heartbeats)
    try:
        for proc, (_, beating) in zip(procs, pipes, strict=True):
            try:
                proc.start()
            except OSError as e:  # it died before taking its arguments
                raise WorkerError(f"tensor-parallel worker {proc.name} did not start: {e}") from e
            finally:
                beating.close()  # the worker's end is the worker's alone
        workers._wait_until_joined()
        workers.group = connect(store, 0, size, config.device, COLLECTIVE_TIMEOUT, LOOPBACK)
    except BaseException:
        workers.stop(polite=False)
        raise
    workers._watcher.start()
    logger.info("Started %d tensor-parallel worker(s): pids %s.", size - 1, [p.pid for p in procs])
    return workers


def _worker_main(
    config: EngineConfig, rank: int, port: int, log_level: int, heartbeat: Connection
) -> None:
    """A spawned worker: beat, join, serve; an error is left in the store for the driver."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    start_beating(heartbeat, beat_interval(config.worker_heartbeat_timeout))
    size = config.tensor_parallel_size
    if config.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore(LOOPBACK, port, size, is_master=False, timeout=START_TIMEOUT)
    try:
        store.set(f"joined/{rank}", "1")
        serve(config, connect(store, rank, size, config.device, COLLECTIVE_TIMEOUT, LOOPBACK))
    except BaseException:
        store.set(f"error/{rank}", traceback.format_exc())
        raise


def _join_torchrun(config: EngineConfig) -> Workers:
    size = config.tensor_parallel_size
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} must equal torchrun's world size ({world})")
    store, _, _ = next(dist.rendezvous("env://", timeout=START_TIMEOUT))
    store = dist.PrefixStore("extkv/", store)
    config = config.for_rank(int(os.environ.get("LOCAL_RANK", rank)))
    group = connect(store, rank, size, config.device, COLLECTIVE_TIMEOUT)
    if rank > 0:
        serve(config, group)
        raise SystemExit(0)
    workers = Workers(store, [])
    workers.group = group
    return workers
