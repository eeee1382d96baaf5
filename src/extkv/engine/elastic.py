"""Elastic memory while serving: the KV cache resized, the engine put to sleep and woken,
between steps and under the CUDA graphs captured at start-up (no address moves, so
nothing is captured again).

Resize: growing commits more blocks, as start-up's extend does. Shrinking first
makes room: the scheduler preempts the most recently admitted sequences holding
blocks past the new end until those blocks fit into the free ones below it
(preempted sequences are recomputed, which gives the same tokens); the others
move, their contents copied on every layer and their table entries and prefix
cache entries rewritten; then the tail's memory goes back, whole granules of it.

Sleep (`enable_sleep_mode`, an idle engine): level 1 gives back the KV cache's
memory and moves the weights to host memory; level 2 drops the weights too.
`wake_up` maps both back under the same addresses, the KV cache zeroed and its
prefix cache empty (what it named is gone: no stale hits after wake). After level
2, waking the weights maps their memory back but fills no parameter yet: that is
left to `load_weights` (new weights, as in an RL loop), and when the engine is
fully awake without them, the checkpoint is read again.

`load_weights` takes (name, tensor) pairs, the checkpoint's names, checks them all
first and copies them into the parameters in place (same addresses: the graphs
stay valid); the prefix cache is emptied, as its blocks hold the old weights' KV.

Under tensor parallelism every rank does each of these in lockstep: the decisions
are taken here once, on the driver, and applied by every rank through
extkv.engine.rank_memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass

import torch

from extkv.engine.config import EngineConfig
from extkv.engine.errors import EngineAsleepError, EngineStateError
from extkv.engine.model_runner import ModelRunner
from extkv.engine.rank_memory import RankCall, RankMemory
from extkv.engine.scheduler import Scheduler
from extkv.kv_cache import KVCache
from extkv.models.loader import check_weights
from extkv.options import Choice, Int

logger = logging.getLogger(__name__)

GiB = 1 << 30
WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)
SLEEP_LEVELS = Choice((1, 2))


@dataclass
class KVCacheResize:
    """What one resize did (`LLM.resize_kv_cache` returns it as a dict)."""

    num_blocks: int  # committed and usable now
    requested_blocks: int  # asked for (memory_bytes: the blocks it holds)
    previous_num_blocks: int
    committed_bytes: int  # physical, whole granules
    previous_committed_bytes: int
    num_moved_blocks: int  # copied below the new end
    num_preempted: int  # sequences that will recompute
    seconds: float

    def as_dict(self) -> dict[str, object]:
        """The fields as a plain dict (JSON for the server)."""
        return asdict(self)


class ElasticMemory:
    """Resizes the KV cache, puts the weights and the KV cache to sleep and back, and loads
    new weights; the engine calls it between steps (and only when idle, for sleep and
    load_weights). `ranks` guards every use of the tensor-parallel workers
    (`Workers.guard`)."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        kv_cache: KVCache,
        scheduler: Scheduler,
        ranks: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.config = config
        self.runner = runner
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.rank = RankMemory(runner, kv_cache)
        self._ranks = ranks
        self.num_grows = 0
        self.num_shrinks = 0
        self.sleep_level = 0  # 0: awake
        self._asleep: set[str] = set()  # of TAGS
        self._kv_blocks = 0  # what the KV cache had when it went to sleep
        self._parameters_unloaded = False  # level 2: woken, not filled yet
        self.num_blocks_per_rank: list[int] = []  # for `status`, kept by `_measure_ranks`
        self.committed_bytes_per_rank: list[int] = []
        self._measure_ranks()

    def _measure_ranks(self) -> None:
        """Take every rank's KV cache size (after every change to it)."""
        sizes = self._on_every_rank("kv_cache_sizes")
        self.num_blocks_per_rank, self.committed_bytes_per_rank = sizes

    def _on_every_rank(self, method: str, *args: object, **driver_only: object) -> object:
        """Run `RankMemory.<method>(*args)` on every rank (`driver_only`: on the driver, which
        sends what the others need); the driver's result."""
        with self._ranks():
            if self.runner.tp.size > 1:
                self.runner.tp.broadcast_object(RankCall(method, args))
            return getattr(self.rank, method)(*args, **driver_only)

    @property
    def asleep(self) -> frozenset[str]:
        """What is asleep now: "weights", "kv_cache", both or neither."""
        return frozenset(self._asleep)

    @property
    def min_blocks(self) -> int:
        """Blocks one sequence of max_model_len tokens needs: no resize goes below."""
        return self.runner.min_blocks

    # --- resizing ------------------------------------------------------------------------

    def resize_kv_cache(
        self, num_blocks: int | None = None, memory_bytes: int | None = None
    ) -> KVCacheResize:
        """Grow or shrink the committed KV cache to `num_blocks`, or to the most blocks whose
        memory (whole granules) is at most `memory_bytes`; exactly one of them."""
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("resize_kv_cache takes exactly one of num_blocks or memory_bytes")
        if not self.kv_cache.extensible:
            raise EngineStateError(
                "resize_kv_cache needs the extensible KV cache (enable_extensible_kv_cache=True); "
                "this one was allocated whole"
            )
        self.check_awake("resize_kv_cache")
        if memory_bytes is not None:
            Int(0).check("memory_bytes", memory_bytes)
            target = self.kv_cache.blocks_within(memory_bytes)
            asked = f"memory_bytes={memory_bytes} holds {target} blocks"
        else:
            target = Int(1).check("num_blocks", num_blocks)
            asked = f"num_blocks={num_blocks}"
        capacity = self.kv_cache.capacity_blocks
        if target > capacity:
            raise ValueError(
                f"{asked}: more than the {capacity} blocks the KV cache's address space was "
                "reserved for at start-up"
            )
        if target < self.min_blocks:
            raise ValueError(
                f"{asked}: fewer than the {self.min_blocks} blocks one sequence of "
                f"max_model_len={self.config.max_model_len} tokens needs "
                f"({self.min_blocks * self.runner.kv_plan.bytes_per_block} bytes)"
            )
        start, before = time.perf_counter(), self.kv_cache.committed_bytes
        previous = self.scheduler.block_manager.num_blocks
        moves, preempted = {}, 0
        if target > previous:
            reached = self._grow(target)
            self.scheduler.resize(reached)
            self.num_grows += reached > previous
        elif target < previous:
            moves, preempted = self.scheduler.resize(target)
            self._on_every_rank("shrink_kv_cache", target, moves)
            reached = target
            self.num_shrinks += 1
        else:
            reached = target
        self._measure_ranks()
        return KVCacheResize(
            num_blocks=reached,
            requested_blocks=target,
            previous_num_blocks=previous,
            committed_bytes=self.kv_cache.committed_bytes,
            previous_committed_bytes=before,
            num_moved_blocks=len(moves),
            num_preempted=preempted,
            seconds=time.perf_counter() - start,
        )

    def _grow(self, num_blocks: int) -> int:
        """Grow every rank's KV cache towards `num_blocks`; the count they all reached."""
        reached = self._on_every_rank("grow_kv_cache", num_blocks)
        if len(set(reached)) > 1:
            logger.info(
                "KV cache grow to %d blocks: the ranks reached %s; every rank keeps %d.",
                num_blocks,
                reached,
                min(reached),
            )
        return min(reached)

    def free_physical_bytes(self) -> int | None:
        """The least memory any rank could commit now (None: nothing bounds any rank's)."""
        bounded = [f for f in self._on_every_rank("free_physical_bytes") if f >= 0]
        return min(bounded) if bounded else None

    def status(self) -> dict[str, object]:
        """The KV cache now: committed, capacity, in use, resizes so far, what sleeps."""
        blocks = self.scheduler.block_manager
        return {
            "extensible": self.kv_cache.extensible,
            "num_blocks": blocks.num_blocks,
            "num_blocks_capacity": self.kv_cache.capacity_blocks,
            "num_blocks_used": blocks.num_used_blocks,
            "num_blocks_used_by_group": blocks.num_used_blocks_by_group,
            "min_blocks": self.min_blocks,
            "bytes_per_block": self.runner.kv_plan.bytes_per_block,
            "committed_bytes": self.kv_cache.committed_bytes,
            "num_blocks_per_rank": self.num_blocks_per_rank,
            "committed_bytes_per_rank": self.committed_bytes_per_rank,
            "reserved_bytes": self.kv_cache.reserved_bytes,
            "num_resizes": {"grow": self.num_grows, "shrink": self.num_shrinks},
            "asleep": sorted(self._asleep),
            "weights_loaded": not self._parameters_unloaded,
        }

    # --- sleep and wake ------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Give back the KV cache's memory and the weights' (level 1: kept in host memory;
        level 2: dropped). The engine must be idle; `level` checked (SLEEP_LEVELS)."""
        if self._asleep:
            raise EngineStateError(
                f"the engine is already asleep (level {self.sleep_level}); wake_up() first"
            )
        weights = self.runner.weights
        assert weights is not None  # enable_sleep_mode
        start = time.perf_counter()
        kv_bytes, weight_bytes = self.kv_cache.committed_bytes, weights.committed_bytes
        self._kv_blocks = self.scheduler.block_manager.num_blocks
        self.scheduler.resize(0)  # idle: nothing moves; the prefix cache goes with its blocks
        self._on_every_rank("sleep_kv_cache")
        self._asleep, self.sleep_level = {KV_CACHE}, level  # wakeable should the next fail
        self._measure_ranks()
        self._on_every_rank("sleep_weights", level)
        self._asleep.add(WEIGHTS)
        logger.info(
            "Sleeping (level %d): gave back %.3f GiB of KV cache and %.3f GiB of weights "
            "(%s) in %.3f s.",
            level,
            kv_bytes / GiB,
            weight_bytes / GiB,
            "kept in host memory" if level == 1 else "dropped",
            time.perf_counter() - start,
        )

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Map back what `tags` name ("weights", "kv_cache"; None: both) under the same
        addresses; waking what is awake does nothing. After level 2 the parameters are
        filled once the engine is fully awake: from the checkpoint, unless `load_weights`
        filled them in between."""
        if tags is None:
            tags = TAGS
        elif isinstance(tags, str) or not all(t in TAGS for t in tags):
            raise ValueError(f"tags must be None or a list of {' and '.join(TAGS)}; got {tags!r}")
        start = time.perf_counter()
        woken = [t for t in TAGS if t in tags and t in self._asleep]
        if WEIGHTS in woken:
            # Level 2 leaves the parameters to fill (level 1 as they were when it slept).
            self._parameters_unloaded |= self._on_every_rank("wake_weights")
            self._asleep.discard(WEIGHTS)
        if KV_CACHE in woken:
            reached = self._on_every_rank("wake_kv_cache", self._kv_blocks, self.min_blocks)
            if reached < self.min_blocks:
                raise EngineStateError(
                    f"not enough memory to wake the KV cache: {reached} blocks fit, one "
                    f"sequence needs {self.min_blocks}; free some and call wake_up again"
                )
            self.scheduler.resize(reached)
            self._asleep.discard(KV_CACHE)
            self._measure_ranks()
        reloaded = not self._asleep and self._parameters_unloaded
        if reloaded:  # fully awake and nobody loaded the parameters (or that failed before)
            self._on_every_rank("reload_weights")
            self._parameters_unloaded = False
        if not self._asleep and self.sleep_level:
            self._on_every_rank("hold_activation_memory")
            self.sleep_level = 0
        if woken or reloaded:
            logger.info(
                "Woke up %s in %.3f s%s.",
                " and ".join(woken) or "nothing",
                time.perf_counter() - start,
                " (parameters read from the checkpoint)" if reloaded else "",
            )
        if self._parameters_unloaded:
            logger.info(
                "The weights' memory is mapped back, their parameters not filled: load_weights "
                "fills them, or the checkpoint once the KV cache wakes."
            )

    # --- new weights ---------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy `weights` ((checkpoint name, tensor) pairs) into the parameters, on every rank,
        in place; all of them checked first. After a level-2 sleep's wake they must cover
        every parameter. The engine must be idle: the prefix cache is emptied."""
        if WEIGHTS in self._asleep:
            raise EngineAsleepError(
                "load_weights: the weights are asleep; wake_up(tags=['weights']) first"
            )
        why_all = "after sleep(level=2) they hold nothing" if self._parameters_unloaded else None
        pairs = check_weights(self.runner.model, weights, why_all)
        start = time.perf_counter()
        specs = [(name, tuple(t.shape), t.dtype) for name, t in pairs]
        self._on_every_rank("load_weights", specs, tensors=[t for _, t in pairs])
        self._parameters_unloaded = False
        self.scheduler.block_manager.reset_prefix_cache()  # its blocks hold the old weights' KV
        logger.info("Loaded %d weight tensors in %.3f s.", len(pairs), time.perf_counter() - start)

    @property
    def sleeping(self) -> bool:
        """Whether the engine cannot serve for sleep: something asleep, or the parameters
        not filled again since a level-2 sleep."""
        return bool(self._asleep) or self._parameters_unloaded

    def check_awake(self, what: str) -> None:
        """Raise EngineAsleepError, naming `what` was refused, while the engine is `sleeping`."""
        if self._asleep:
            raise EngineAsleepError(
                f"{what}: the engine is asleep ({' and '.join(sorted(self._asleep))}); "
                "call wake_up() first"
            )
        if self._parameters_unloaded:
            raise EngineAsleepError(
                f"{what}: the parameters dropped by sleep(level=2) are not loaded; call "
                "load_weights(...) or wake_up() (which reads the checkpoint)"
            )
