"""One rank's share of elastic memory: its KV cache and its weights, changed in lockstep.

Under tensor parallelism every rank holds its own KV cache (its heads of every
block) and its own shard of the weights, but the blocks are the driver's: one
scheduler hands them out and every rank's block tables are the driver's. So the
driver decides each change once (`ElasticMemory`: the new block count, the blocks
that move, the requests preempted) and every rank, the driver included, applies it
between two steps by running the same `RankMemory` method: the driver sends a
`RankCall` where a step's inputs would go (extkv.engine.workers), then runs it
itself. Where memory decides (a grow), the ranks agree on the smallest result.
With one rank the driver just runs the method.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from extkv.engine.model_runner import ModelRunner
from extkv.kv_cache import KVCache
from extkv.models.loader import fill_weights, reload_weights

logger = logging.getLogger(__name__)

# (name, shape, dtype) of a tensor `load_weights` sends to every rank.
WeightSpec = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class RankCall:
    """`RankMemory.<method>(*args)`, sent by the driver for every rank to run."""

    method: str
    args: tuple[object, ...] = ()

    def run(self, rank: RankMemory) -> object:
        return getattr(rank, self.method)(*self.args)


class RankMemory:
    """What every rank does to its own KV cache and weights when the driver says so; each
    method runs on all ranks at once (those that take a collective rely on it)."""

    def __init__(self, runner: ModelRunner, kv_cache: KVCache) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.tp = runner.tp

    def grow_kv_cache(self, num_blocks: int) -> list[int]:
        """Commit blocks up to `num_blocks`, or as many as memory allows; then every rank
        keeps the smallest count any rank reached (the blocks past it were just committed,
        so nothing is lost). Every rank's count, in rank order."""
        reached = self.tp.all_gather_ints(self.kv_cache.extend(num_blocks))
        self.kv_cache.shrink(min(reached))
        return reached

    def shrink_kv_cache(self, num_blocks: int, moves: dict[int, int]) -> None:
        """Copy the blocks that move below `num_blocks` ({old: new}), then give the tail back."""
        self.kv_cache.copy_blocks(moves)
        self.kv_cache.shrink(num_blocks)

    def kv_cache_sizes(self) -> tuple[list[int], list[int]]:
        """Every rank's committed KV cache blocks and bytes, in rank order (the bytes may
        differ: each rank's address space, sized by its own memory, puts its granule
        boundaries elsewhere)."""
        tp, cache = self.tp, self.kv_cache
        return tp.all_gather_ints(cache.num_blocks), tp.all_gather_ints(cache.committed_bytes)

    def free_physical_bytes(self) -> list[int]:
        """Every rank's memory that could be committed now, in rank order (-1: nothing
        bounds it, as with host memory without a limit)."""
        free = self.kv_cache.free_physical_bytes()
        return self.tp.all_gather_ints(-1 if free is None else free)

    def sleep_kv_cache(self) -> None:
        """Give the whole KV cache's memory back (the pool was emptied first)."""
        self.kv_cache.shrink(0)

    def sleep_weights(self, level: int) -> None:
        """Give the weights' memory back: kept in host memory (level 1) or dropped (2);
        and the activation memory torch holds for the eager steps."""
        self.runner.weights.offload(keep_parameters=level == 1)
        self.runner.release_activation_memory()

    def hold_activation_memory(self) -> None:
        """Awake again: take the activation memory back into torch's cache."""
        self.runner.hold_activation_memory()

    def wake_weights(self) -> bool:
        """Map the weights back under their addresses; whether the parameters were dropped
        (level 2) and still have to be filled (`reload_weights` or `load_weights`)."""
        return self.runner.weights.restore()

    def reload_weights(self) -> None:
        """Fill this rank's shard of the parameters from the checkpoint again."""
        config = self.runner.config
        reload_weights(self.runner.model, config.model, config.dtype, config.device)

    def wake_kv_cache(self, num_blocks: int, min_blocks: int) -> int:
        """Commit the KV cache again, up to `num_blocks`; the count the ranks agreed on.
        Below `min_blocks` (one sequence) none is kept."""
        agreed = min(self.grow_kv_cache(num_blocks))
        if agreed < min_blocks:
            self.kv_cache.shrink(0)
        return agreed

    def load_weights(
        self, specs: list[WeightSpec], tensors: list[torch.Tensor] | None = None
    ) -> None:
        """Load the weights `specs` names (checked by the driver) into this rank's shard, in
        place. The driver passes the `tensors`; under tensor parallelism it broadcasts each
        in turn and every rank cuts its own shard out of it."""
        names = [name for name, _, _ in specs]
        if self.tp.size == 1:
            fill_weights(self.runner.model, names, tensors)
        else:
            fill_weights(self.runner.model, names, self._received(specs, tensors))

    def _received(
        self, specs: list[WeightSpec], tensors: list[torch.Tensor] | None
    ) -> Iterator[torch.Tensor]:
        """The driver's tensors, one at a time, on this rank's device."""
        device = self.runner.device
        for i, (_, shape, dtype) in enumerate(specs):
            if self.tp.rank == 0:
                tensor = tensors[i].to(device).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            yield self.tp.broadcast(tensor)
