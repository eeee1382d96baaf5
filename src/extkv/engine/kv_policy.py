"""The elastic KV cache policy: commit what the load needs, within what the budget allows.

Start-up reserves and sizes the KV cache as the static policy does; that size (what
gpu_memory_utilization or cpu_memory_budget_bytes allow) is the *ceiling*, but only the
*floor* is committed: the granules one max_model_len sequence needs, whole ones
(committing a block commits its granules, so the other blocks they hold cost nothing).
Then, between steps, through the same resize as `LLM.resize_kv_cache`:

- grow: where the scheduler would leave a request waiting or preempt one for lack of
  blocks, it asks `grow` for them first; the cache grows by whole granules, up to the
  ceiling. A grow the device refuses (its memory is taken, e.g. by another engine) is no
  error: the cache stays at its size and requests wait, as under the static policy. That
  is logged once, and no grow is tried again until the device reports more free memory
  than it did then (so a full device costs no grow attempt per step). Under tensor
  parallelism every rank grows and shrinks with the driver (extkv.engine.rank_memory):
  a grow reaches what the poorest rank could commit, and "free memory" is the least any
  rank has.
- give back: `release_idle`, called after every step (and by the server while idle),
  keeps the most blocks held at once during the last `kv_idle_release_s` seconds (blocks
  committed in that time, by a grow or by `resize_kv_cache`, count as held), rounded up
  to whole granules and at least the floor, and shrinks to that. No request is
  preempted (at least as many blocks as are held stay), but held blocks past the new end
  move below it (a copy per block and layer): the pool hands out the least recently
  freed block first (prefix caching), so under load held blocks are scattered and a free
  tail alone would rarely form, stranding memory no request uses.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from extkv.engine.elastic import ElasticMemory
from extkv.kv_cache import KVCache

logger = logging.getLogger(__name__)

STATIC_STATUS: dict[str, object] = {
    "policy": "static",
    "num_blocks_floor": None,
    "num_blocks_ceiling": None,
    "idle_release_s": None,
    "grow_held_back": False,
}


def floor_blocks(cache: KVCache, min_blocks: int, ceiling: int) -> int:
    """The elastic policy's floor: the blocks the granules of `min_blocks` hold (one
    max_model_len sequence), at most `ceiling`."""
    return min(cache.whole_granules(min_blocks), ceiling)


class ElasticKVCachePolicy:
    """Grows the KV cache when blocks run short and gives back blocks left unused for
    `idle_release_s` seconds, between `floor_blocks` and `ceiling`; `clock` (seconds,
    monotonic) is injectable so that tests need not sleep."""

    def __init__(
        self,
        elastic: ElasticMemory,
        ceiling: int,
        idle_release_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.elastic = elastic
        self.blocks = elastic.scheduler.block_manager
        self.ceiling = ceiling
        # Start-up committed the floor: the smallest of every rank's floor_blocks (ranks
        # place their granule boundaries apart).
        self.floor = self.blocks.num_blocks
        self.idle_release_s = idle_release_s
        self.clock = clock
        # (time, the most blocks held since the entry before): a window of the last
        # idle_release_s seconds, peaks decreasing, so its first entry is the window's most.
        self._peaks: deque[tuple[float, int]] = deque()
        self._free_when_refused: int | None = None  # the device's free bytes at a refused grow
        self._whole: dict[int, int] = {}  # whole_granules, memoised: the geometry is fixed
        self._last_num_blocks = self.blocks.num_blocks  # at the last release_idle
        logger.info(
            "Elastic KV cache policy: %d blocks committed, growing on demand up to %d; "
            "blocks unused for %g s are given back.",
            self.blocks.num_blocks,
            ceiling,
            idle_release_s,
        )

    def grow(self, num_missing: int) -> bool:
        """Grow by whole granules to hold `num_missing` more blocks, within the ceiling;
        whether the pool grew at all (a refused grow leaves it as it is)."""
        current = self.blocks.num_blocks
        if current >= self.ceiling or self._held_back():
            return False
        target = min(self._whole_granules(current + num_missing), self.ceiling)
        reached = self.elastic.resize_kv_cache(num_blocks=target).num_blocks
        if reached < target:
            if self._free_when_refused is None:
                logger.warning(
                    "Elastic KV cache: no memory to grow from %d to %d blocks; serving with %d "
                    "(requests wait) until the device has memory to spare.",
                    current,
                    target,
                    reached,
                )
            self._free_when_refused = self.elastic.free_physical_bytes() or 0
        elif self._free_when_refused is not None:
            logger.info("Elastic KV cache: memory to grow again; %d blocks now.", reached)
            self._free_when_refused = None
        return reached > current

    def release_idle(self) -> float | None:
        """Shrink to the most blocks held at once in the last `idle_release_s` seconds
        (whole granules, at least the floor); return the seconds until the next release
        may come, None when the cache is at its floor (or asleep)."""
        if self.elastic.sleeping:
            return None
        now = self.clock()
        peak = self.blocks.take_peak_used()
        if self.blocks.num_blocks > self._last_num_blocks:  # committed just now: not idle yet
            peak = self.blocks.num_blocks
        while self._peaks and self._peaks[-1][1] <= peak:
            self._peaks.pop()
        self._peaks.append((now, peak))
        while self._peaks[0][0] <= now - self.idle_release_s:  # never the entry just added
            self._peaks.popleft()
        target = max(self._whole_granules(self._peaks[0][1]), self.floor)
        if target < self.blocks.num_blocks:
            self.elastic.resize_kv_cache(num_blocks=target)
        self._last_num_blocks = self.blocks.num_blocks
        if self.blocks.num_blocks <= self.floor:
            return None
        return self._peaks[0][0] + self.idle_release_s - now

    def status(self) -> dict[str, object]:
        """The policy's part of `kv_cache_status` (STATIC_STATUS's keys)."""
        return {
            "policy": "elastic",
            "num_blocks_floor": self.floor,
            "num_blocks_ceiling": self.ceiling,
            "idle_release_s": self.idle_release_s,
            "grow_held_back": self._free_when_refused is not None,
        }

    def _held_back(self) -> bool:
        """Whether a grow was refused and the device has not freed memory since."""
        if self._free_when_refused is None:
            return False
        free = self.elastic.free_physical_bytes()  # None: nothing bounds it now
        return free is not None and free <= self._free_when_refused

    def _whole_granules(self, num_blocks: int) -> int:
        if num_blocks not in self._whole:
            self._whole[num_blocks] = self.elastic.kv_cache.whole_granules(num_blocks)
        return self._whole[num_blocks]
