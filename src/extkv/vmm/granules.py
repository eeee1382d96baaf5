"""Which granules of a reservation are backed by physical memory.

Commits arrive as byte ranges (one per segment); they are rounded out to
granules, merged, and every contiguous run of still-unmapped granules becomes
ONE physical allocation with one map and one access call, because per-call
driver cost dominates (4 GiB in 2 MiB pieces ~0.13 s, in one piece ~1 ms on an
H200). A granule touched by two ranges, e.g. one straddling a segment
boundary, is therefore mapped exactly once. Runs are cut only at the fixed
MAX_ALLOCATION_BYTES grid of the reservation: 100 GiB is still ~100 calls, and a
shrink that ends inside an allocation has at most one chunk's kept bytes to copy
(below), instead of the whole cache, which would not fit beside itself.

Releases arrive as the byte ranges still needed: every mapped granule none of
them touches is given back. An allocation wholly outside goes at once; one cut
by the ranges (a run mapped as one piece, of which only a head is still needed)
is handed to the backend's `unmap_part`, which keeps the needed pieces as
allocations of their own. Where that needs memory the backend has not got, the
allocation stays whole: correct, only less memory given back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from extkv.vmm.backend import Backend, VirtualMemoryOutOfMemory

logger = logging.getLogger(__name__)

MAX_ALLOCATION_BYTES = 1 << 30  # one physical allocation spans at most this (one grid cell)


@dataclass
class _Allocation:
    first_granule: int
    num_granules: int
    handle: object


class GranuleMap:
    """Which granules of one reservation are mapped: each mapped once, all undoable."""

    def __init__(self, backend: Backend, base: int, num_granules: int) -> None:
        self._backend = backend
        self._chunk = max(1, MAX_ALLOCATION_BYTES // backend.granularity)  # granules
        self._base = base
        self._mapped = bytearray(num_granules)  # 1 = backed by physical memory
        self._allocations: list[_Allocation] = []

    @property
    def num_allocations(self) -> int:
        """Live physical allocations; fewer means fewer driver calls per commit."""
        return len(self._allocations)

    @property
    def committed_bytes(self) -> int:
        """Physical bytes held: whole granules, so rounded up from what was asked."""
        return sum(a.num_granules for a in self._allocations) * self._backend.granularity

    def commit(self, byte_ranges: Iterable[tuple[int, int]]) -> None:
        """Back every byte of the given [start, end) ranges. All or nothing: if an
        allocation fails, the ones this call made are undone before re-raising."""
        made: list[_Allocation] = []
        try:
            for first, count in self._unmapped_runs(byte_ranges):
                granularity = self._backend.granularity
                handle = self._backend.map(self._base + first * granularity, count * granularity)
                made.append(_Allocation(first, count, handle))
                self._mapped[first : first + count] = b"\x01" * count
        except BaseException:
            for allocation in reversed(made):
                self._unmap(allocation)
            raise
        self._allocations.extend(made)

    def release_outside(self, byte_ranges: Iterable[tuple[int, int]]) -> None:
        """Give back every mapped granule that none of the [start, end) ranges touches;
        the bytes of the granules they touch stay as they are."""
        needed = bytearray(len(self._mapped))
        for lo, hi in self._spans(byte_ranges):
            needed[lo:hi] = b"\x01" * (hi - lo)
        kept: list[_Allocation] = []
        left = list(self._allocations)
        try:
            while left:
                allocation = left[0]
                first, count = allocation.first_granule, allocation.num_granules
                pieces = _runs(needed, 1, first, first + count)
                if pieces == [(first, count)]:
                    kept.append(allocation)
                elif not pieces:
                    self._unmap(allocation)
                else:
                    kept += self._unmap_part(allocation, pieces)
                left.pop(0)
        finally:  # a driver error: what was done stays done, the rest as it was
            self._allocations = kept + left

    def release_all(self) -> None:
        """Unmap every allocation, newest first, leaving the reservation itself intact."""
        while self._allocations:
            self._unmap(self._allocations.pop())

    def _unmap(self, allocation: _Allocation) -> None:
        granularity = self._backend.granularity
        self._backend.unmap(
            self._base + allocation.first_granule * granularity,
            allocation.num_granules * granularity,
            allocation.handle,
        )
        first, count = allocation.first_granule, allocation.num_granules
        self._mapped[first : first + count] = bytes(count)

    def _unmap_part(
        self, allocation: _Allocation, pieces: list[tuple[int, int]]
    ) -> list[_Allocation]:
        """Unmap `allocation` but its `pieces` (first granule, count), which become
        allocations of their own; the whole allocation when the backend lacks the memory."""
        granularity = self._backend.granularity
        first, count = allocation.first_granule, allocation.num_granules
        keep = [((lo - first) * granularity, n * granularity) for lo, n in pieces]
        try:
            handles = self._backend.unmap_part(
                self._base + first * granularity, count * granularity, allocation.handle, keep
            )
        except VirtualMemoryOutOfMemory as e:
            logger.warning(
                "Kept %d granule(s) mapped that could be given back: splitting their "
                "allocation needs memory (%s).",
                count - sum(n for _, n in pieces),
                e,
            )
            return [allocation]
        self._mapped[first : first + count] = bytes(count)
        for lo, n in pieces:
            self._mapped[lo : lo + n] = b"\x01" * n
        return [_Allocation(lo, n, h) for (lo, n), h in zip(pieces, handles, strict=True)]

    def _spans(self, byte_ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The granules the ranges touch, as sorted, disjoint [first, end) spans."""
        granularity = self._backend.granularity
        spans = sorted(
            (start // granularity, -(-end // granularity))
            for start, end in byte_ranges
            if end > start
        )
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [(lo, hi) for lo, hi in merged]

    def _unmapped_runs(self, byte_ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """(first granule, count) of each maximal run of unmapped granules the ranges touch,
        cut at the allocation grid."""
        chunk = self._chunk
        return [
            (start, min(first + count, (start // chunk + 1) * chunk) - start)
            for lo, hi in self._spans(byte_ranges)
            for first, count in _runs(self._mapped, 0, lo, hi)
            for start in [first, *range((first // chunk + 1) * chunk, first + count, chunk)]
        ]


def _runs(flags: bytearray, value: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """(first, count) of each maximal run of `value` in flags[lo:hi]."""
    runs = []
    start = flags.find(value, lo, hi)
    while start != -1:
        end = flags.find(1 - value, start, hi)
        end = hi if end == -1 else end
        runs.append((start, end - start))
        start = flags.find(value, end, hi)
    return runs
