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
memory and moves the weights to host memory; level 2 drops the weights too, and
waking reads them from the checkpoint again. `wake_up` maps both back under the
same addresses, the KV cache zeroed and its prefix cache empty (what it named is
gone: no stale hits after wake).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from extkv.engine.config import EngineConfig
from extkv.engine.errors import EngineAsleepError, EngineStateError
from extkv.engine.model_runner import ModelRunner
from extkv.engine.scheduler import Scheduler
from extkv.kv_cache import KVCache
from extkv.models.loader import reload_weights
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
    """Resizes the KV cache and puts the weights and the KV cache to sleep and back; the
    engine calls it between steps (and only when idle, for sleep)."""

    def __init__(
        self, config: EngineConfig, runner: ModelRunner, kv_cache: KVCache, scheduler: Scheduler
    ) -> None:
        self.config = config
        self.runner = runner
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.num_grows = 0
        self.num_shrinks = 0
        self.sleep_level = 0  # 0: awake
        self._asleep: set[str] = set()  # of TAGS
        self._kv_blocks = 0  # what the KV cache had when it went to sleep

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
        if self.runner.tp.size > 1:
            raise EngineStateError(
                "resize_kv_cache needs tensor_parallel_size=1 (the workers cannot resize yet)"
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
            reached = self.kv_cache.extend(target)
            self.scheduler.resize(reached)
            self.num_grows += reached > previous
        elif target < previous:
            moves, preempted = self.scheduler.resize(target)
            self.kv_cache.copy_blocks(moves)
            reached = self.kv_cache.shrink(target)
            self.num_shrinks += 1
        else:
            reached = target
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
            "reserved_bytes": self.kv_cache.reserved_bytes,
            "num_resizes": {"grow": self.num_grows, "shrink": self.num_shrinks},
            "asleep": sorted(self._asleep),
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
        self.kv_cache.shrink(0)
        self._asleep, self.sleep_level = {KV_CACHE}, level  # wakeable should the next fail
        weights.offload(keep_parameters=level == 1)
        self._asleep.add(WEIGHTS)
        logger.info(
            "Sleeping (level %d): gave back %.3f GiB of KV cache and %.3f GiB of weights "
            "(%s) in %.3f s.",
            level,
            kv_bytes / GiB,
            weight_bytes / GiB,
            "kept in host memory" if level == 1 else "dropped: wake_up reads the checkpoint",
            time.perf_counter() - start,
        )

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Map back what `tags` name ("weights", "kv_cache"; None: both) under the same
        addresses; waking what is awake does nothing."""
        if tags is None:
            tags = TAGS
        elif isinstance(tags, str) or not all(t in TAGS for t in tags):
            raise ValueError(f"tags must be None or a list of {' and '.join(TAGS)}; got {tags!r}")
        start = time.perf_counter()
        woken = [t for t in TAGS if t in tags and t in self._asleep]
        if WEIGHTS in woken:
            model = self.runner.model
            config = self.config
            self.runner.weights.restore(
                lambda: reload_weights(model, config.model, config.dtype, config.device)
            )
        if KV_CACHE in woken:
            reached = self.kv_cache.extend(self._kv_blocks)
            if reached < self.min_blocks:
                self.kv_cache.shrink(0)
                raise EngineStateError(
                    f"not enough memory to wake the KV cache: {reached} blocks fit, one "
                    f"sequence needs {self.min_blocks}; free some and call wake_up again"
                )
            self.scheduler.resize(reached)
        self._asleep -= set(woken)
        if not self._asleep:
            self.sleep_level = 0
        if woken:
            logger.info("Woke up %s in %.3f s.", " and ".join(woken), time.perf_counter() - start)

    def check_awake(self, what: str) -> None:
        """Raise EngineAsleepError, naming `what` was refused, while anything sleeps."""
        if self._asleep:
            raise EngineAsleepError(
                f"{what}: the engine is asleep ({' and '.join(sorted(self._asleep))}); "
                "call wake_up() first"
            )
