"""The KV cache: one buffer per KV cache tensor, a view per layer, growth in place.

Legacy: every buffer is one plain zeroed allocation of all its blocks.
Extensible: every buffer is an ExtensibleTensor reserved for all
`config.num_blocks` blocks with one block per segment committed, so CUDA graphs
can be captured against the final addresses before the cache is sized;
`extend` then commits the blocks that memory turned out to allow. While the
engine serves, `shrink` gives the tail back (the engine first moves the blocks
in use there with `copy_blocks`) and `extend` grows it again, under the same
addresses, so the captured graphs stay valid.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from extkv.kv_cache.groups import KVCacheConfig, KVCacheTensor
from extkv.kv_cache.layouts import AttentionLayout, mamba_state_views
from extkv.kv_cache.specs import KVCacheSpec, MambaSpec
from extkv.vmm import (
    ExtensibleTensor,
    VirtualMemoryOutOfMemory,
    allocation_granularity,
    free_physical_bytes,
    resolve_device,
)
from extkv.vmm.backend import Backend
from extkv.vmm.tensor import DeviceLike

logger = logging.getLogger(__name__)

LayerView = torch.Tensor | tuple[torch.Tensor, ...]
GiB = 1 << 30
# Free memory beyond this much more than an extend needs is trusted without a probe.
_PROBE_SLACK_BYTES = 64 << 20


def layer_segments(spec: KVCacheSpec, layout: AttentionLayout | None, num_blocks: int) -> int:
    """Segments of a layer's buffer: Mamba pages are block-major; attention asks its layout."""
    if isinstance(spec, MambaSpec):
        return 1
    if layout is None:
        raise ValueError("layouts must give an AttentionLayout for every attention layer")
    return layout.num_segments(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)


def _layer_view(
    data: torch.Tensor, spec: KVCacheSpec, layout: AttentionLayout | None, num_blocks: int
) -> LayerView:
    if isinstance(spec, MambaSpec):
        return mamba_state_views(data, spec, num_blocks)
    assert layout is not None  # layer_segments checked
    return layout.view(
        data, spec.dtype, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
    )


def _check_layout(name: str, spec: KVCacheSpec, layout: AttentionLayout | None) -> None:
    """A layout must cover exactly one page per block of exactly this layer."""
    if isinstance(spec, MambaSpec):
        return
    if layout is None:
        raise ValueError(f"layouts has no AttentionLayout for attention layer {name!r}")
    shape = layout.kv_cache_shape(1, spec.block_size, spec.num_kv_heads, spec.head_size)
    block_bytes = math.prod(shape) * spec.dtype.itemsize
    if block_bytes != spec.page_size_bytes:
        raise ValueError(
            f"layout {layout.name!r} of layer {name!r} puts {block_bytes} bytes in a block, but "
            f"{type(spec).__name__} pages hold {spec.page_size_bytes}; use 'mla' for MLA and "
            "'split' or 'block_major' otherwise (packed multi-layer layouts are not supported)"
        )


def _granules_backing(memory: ExtensibleTensor, bytes_per_segment: int, granularity: int) -> int:
    """Granules an ExtensibleTensor maps for a `bytes_per_segment` prefix of every segment:
    each prefix rounded out to granules, a granule shared by two prefixes counted once."""
    count = covered_to = 0
    for i in range(memory.num_segments):
        start = i * memory.segment_capacity_bytes
        first = max(start // granularity, covered_to)
        end = -(-(start + bytes_per_segment) // granularity)
        count += max(end - first, 0)
        covered_to = max(covered_to, end)
    return count


@dataclass
class _Buffer:
    """One KV cache tensor's memory and the block geometry of its segments."""

    data: torch.Tensor  # uint8 over the full capacity
    memory: ExtensibleTensor | None  # None when allocated whole (legacy)
    segment_block_bytes: int  # bytes one block takes in each segment
    kind: str  # "attention", "mamba", or "attention+mamba" when shared across kinds

    @property
    def committed_bytes(self) -> int:
        return self.data.numel() if self.memory is None else self.memory.committed_bytes

    @property
    def num_blocks(self) -> int:
        assert self.memory is not None
        return self.memory.bytes_per_segment // self.segment_block_bytes

    def blocks(self, capacity_blocks: int) -> torch.Tensor:
        """The buffer as (segments, blocks, bytes of a block in a segment): block `b` of
        every layer sharing it is `[:, b]`, whatever the layout."""
        segments = self.data.numel() // (capacity_blocks * self.segment_block_bytes)
        return self.data.view(segments, capacity_blocks, self.segment_block_bytes)

    def shrink(self, num_blocks: int) -> None:
        """Give back the memory of the blocks from `num_blocks` on (whole granules)."""
        assert self.memory is not None
        self.memory.shrink_per_segment_(num_blocks * self.segment_block_bytes)

    def grow(self, num_blocks: int) -> None:
        """Commit and zero blocks up to `num_blocks` (nothing if that many are there)."""
        assert self.memory is not None
        if num_blocks > self.num_blocks:
            self.memory.resize_per_segment_(num_blocks * self.segment_block_bytes, zero_new=True)

    def grow_as_far_as_fits(self, num_blocks: int) -> int:
        """Grow to `num_blocks`, or to the most blocks memory allows; return the count."""
        low, high = self.num_blocks, num_blocks
        while low < high:
            mid = (low + high + 1) // 2
            try:
                self.grow(mid)
                low = mid
            except VirtualMemoryOutOfMemory:
                high = mid - 1
        return low

    def bytes_to_grow(self, num_blocks: int, granularity: int) -> int:
        """Physical bytes growing to `num_blocks` would map."""
        assert self.memory is not None
        target = max(num_blocks, self.num_blocks) * self.segment_block_bytes
        granules = _granules_backing(self.memory, target, granularity)
        return granules * granularity - self.memory.committed_bytes


class KVCache:
    """All layers' KV cache. `layer_views` span the full capacity and never move.

    Attention views have the layout's logical shape; Mamba views are one tensor
    per state, `(num_blocks, *state_shape)`. Only blocks below `num_blocks` may
    be touched: in an extensible cache the rest is not backed by memory yet.
    `backend` (extensible only) overrides the virtual-memory backend, e.g. a
    `HostBackend` with a commit limit.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        layouts: Mapping[str, AttentionLayout],
        device: DeviceLike,
        extensible: bool,
        *,
        backend: Backend | None = None,
    ) -> None:
        self.config = config
        self.extensible = extensible
        self.capacity_blocks = config.num_blocks
        self._device = resolve_device(device)
        self._backend = backend
        specs = config.layer_specs()
        self._layouts = {
            name: layouts[name]
            for name, spec in specs.items()
            if spec.kind == "attention" and name in layouts
        }
        segments = [self._agreed_segments(tensor, specs) for tensor in config.tensors]

        self._buffers: list[_Buffer] = []
        self.layer_views: dict[str, LayerView] = {}
        try:
            for tensor, num_segments in zip(config.tensors, segments, strict=True):
                buffer = self._allocate(tensor, num_segments, specs)
                self._buffers.append(buffer)
                for name in tensor.shared_by:
                    self.layer_views[name] = _layer_view(
                        buffer.data, specs[name], self._layouts.get(name), self.capacity_blocks
                    )
        except BaseException:
            self.free()
            raise
        self._num_blocks = 1 if extensible else config.num_blocks

    def _agreed_segments(self, tensor: KVCacheTensor, specs: Mapping[str, KVCacheSpec]) -> int:
        counts = {}
        for name in tensor.shared_by:
            layout = self._layouts.get(name)
            _check_layout(name, specs[name], layout)
            counts[name] = layer_segments(specs[name], layout, self.capacity_blocks)
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"layers sharing one KV cache tensor must agree on segments, got {counts}; "
                "in a hybrid model pass layouts re-strided with hybrid_layout() (1 segment)"
            )
        return counts[tensor.shared_by[0]]

    def _allocate(
        self, tensor: KVCacheTensor, num_segments: int, specs: Mapping[str, KVCacheSpec]
    ) -> _Buffer:
        kind = "+".join(sorted({specs[name].kind for name in tensor.shared_by}))
        segment_block_bytes = tensor.size // self.capacity_blocks // num_segments
        if not self.extensible:
            data = torch.zeros(tensor.size, dtype=torch.uint8, device=self._device)
            return _Buffer(data, None, segment_block_bytes, kind)
        memory = ExtensibleTensor(tensor.size, self._device, num_segments, backend=self._backend)
        try:
            memory.resize_per_segment_(segment_block_bytes, zero_new=True)
        except BaseException:
            memory.free()
            raise
        return _Buffer(memory.full_view(), memory, segment_block_bytes, kind)

    # --- sizes -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks backed by memory and zeroed: the ones the scheduler may hand out."""
        return self._num_blocks

    @property
    def reserved_bytes(self) -> int:
        """Address space held for every block the cache may grow to (legacy: all committed)."""
        return sum(
            b.data.numel() if b.memory is None else b.memory.capacity_bytes for b in self._buffers
        )

    @property
    def committed_bytes(self) -> int:
        """Physical bytes the buffers hold now, granule rounding included."""
        return sum(b.committed_bytes for b in self._buffers)

    def bytes_by_kind(self) -> dict[str, int]:
        """Committed bytes per layer kind; shared hybrid buffers count as "attention+mamba"."""
        totals: dict[str, int] = {}
        for buffer in self._buffers:
            totals[buffer.kind] = totals.get(buffer.kind, 0) + buffer.committed_bytes
        return totals

    @property
    def commit_rounding_bytes(self) -> int:
        """The most that granule rounding can add to the committed bytes of the blocks
        in use: a partial granule at the end of each segment."""
        if not self.extensible:
            return 0
        segments = sum(b.memory.num_segments for b in self._buffers if b.memory is not None)
        return segments * self._granularity

    # --- views -------------------------------------------------------------------------

    def kv_views(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of an attention layer, each (num_blocks, block_size, heads, head)."""
        if name not in self._layouts:
            raise ValueError(f"kv_views needs an attention layer; {name!r} is not one")
        return self._layouts[name].kv_views(self.layer_views[name])

    # --- growth and shrinking ------------------------------------------------------------

    def extend(self, num_blocks: int) -> int:
        """Commit and zero blocks up to `num_blocks`; return the count now usable.

        If memory runs short, commits the largest count every buffer can hold and
        warns. The count is found with a scratch allocation before anything is
        committed: committing some buffers to a count the others cannot reach would
        strand memory until a shrink (and, on CUDA, cost a copy to give it back).
        """
        self._require_extensible("extend")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if num_blocks > self.capacity_blocks:
            raise ValueError(
                f"num_blocks ({num_blocks}) exceeds the KV cache capacity of "
                f"{self.capacity_blocks} blocks"
            )
        if num_blocks <= self._num_blocks:
            return self._num_blocks
        start, before = time.perf_counter(), self.committed_bytes
        reached = self._largest_fitting(num_blocks)
        for buffer in self._buffers:  # grow_as_far_as_fits covers memory taken meanwhile
            reached = buffer.grow_as_far_as_fits(reached)
        self._num_blocks = reached
        if reached < num_blocks:
            logger.warning(
                "Out of memory extending the KV cache to %d blocks; extended to %d blocks.",
                num_blocks,
                reached,
            )
        self._log_resize("Extended", before, start)
        return reached

    def shrink(self, num_blocks: int) -> int:
        """Give back the memory of the blocks from `num_blocks` on, whole granules of it,
        under the same addresses; return `num_blocks`. What those blocks held is lost:
        the engine moves the ones in use first (`copy_blocks`)."""
        self._require_extensible("shrink")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_blocks > self._num_blocks:
            raise ValueError(
                f"shrink cannot grow the KV cache from {self._num_blocks} to {num_blocks} "
                "blocks; use extend"
            )
        if num_blocks == self._num_blocks:
            return num_blocks
        start, before = time.perf_counter(), self.committed_bytes
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # no kernel may still read what goes
        for buffer in self._buffers:
            buffer.shrink(num_blocks)
        self._num_blocks = num_blocks
        self._log_resize("Shrank", before, start)
        return num_blocks

    def _log_resize(self, verb: str, before: int, start: float) -> None:
        committed = self.committed_bytes
        logger.info(
            "%s KV cache to %d blocks. %.3f GiB committed (%+.3f GiB) in %.3f s.",
            verb,
            self._num_blocks,
            committed / GiB,
            (committed - before) / GiB,
            time.perf_counter() - start,
        )

    def copy_blocks(self, moves: Mapping[int, int]) -> None:
        """Copy block `src` to block `dst` for every `src: dst` of `moves`, on every layer
        (every buffer, every segment); all of them must be committed."""
        if not moves:
            return
        outside = [b for b in (*moves, *moves.values()) if not 0 <= b < self._num_blocks]
        if outside:
            raise ValueError(
                f"copy_blocks needs committed blocks, in [0, {self._num_blocks}); got {outside}"
            )
        src = torch.tensor(list(moves), device=self._device)
        dst = torch.tensor(list(moves.values()), device=self._device)
        for buffer in self._buffers:
            blocks = buffer.blocks(self.capacity_blocks)
            blocks[:, dst] = blocks[:, src]

    def bytes_for(self, num_blocks: int) -> int:
        """Physical bytes `num_blocks` committed blocks take: whole granules."""
        self._require_extensible("bytes_for")
        granularity = self._granularity
        return granularity * sum(
            _granules_backing(b.memory, num_blocks * b.segment_block_bytes, granularity)
            for b in self._buffers
        )

    def blocks_within(self, num_bytes: int) -> int:
        """The most blocks whose committed memory (whole granules) is at most `num_bytes`."""
        low, high = 0, self.capacity_blocks
        while low < high:
            mid = (low + high + 1) // 2
            if self.bytes_for(mid) <= num_bytes:
                low = mid
            else:
                high = mid - 1
        return low

    def whole_granules(self, num_blocks: int) -> int:
        """The most blocks the granules backing `num_blocks` hold: committing `num_blocks`
        commits that many anyway, so a resize by whole granules goes there."""
        return self.blocks_within(self.bytes_for(num_blocks))

    def free_physical_bytes(self) -> int | None:
        """What could be committed now on the cache's device (None: nothing bounds it)."""
        return free_physical_bytes(self._device, self._backend)

    def _require_extensible(self, member: str) -> None:
        if not self.extensible:
            raise RuntimeError(
                f"{member} needs an extensible KV cache (extensible=True); this one was "
                "allocated whole"
            )

    @functools.cached_property
    def _granularity(self) -> int:
        return allocation_granularity(self._device, self._backend)

    def _fits(self, num_blocks: int) -> bool:
        """Whether the memory growing to `num_blocks` needs can be committed right now."""
        need = sum(b.bytes_to_grow(num_blocks, self._granularity) for b in self._buffers)
        free = free_physical_bytes(self._device, self._backend)
        if need == 0 or free is None or free >= need + _PROBE_SLACK_BYTES:
            return True  # clearly fits: skip the scratch allocation (a third of extend's time)
        scratch = ExtensibleTensor(need, self._device, backend=self._backend)
        try:
            scratch.resize_(need)
            return True
        except VirtualMemoryOutOfMemory:
            return False
        finally:
            scratch.free()

    def _largest_fitting(self, num_blocks: int) -> int:
        if self._fits(num_blocks):
            return num_blocks
        low, high = self._num_blocks, num_blocks - 1
        while low < high:
            mid = (low + high + 1) // 2
            if self._fits(mid):
                low = mid
            else:
                high = mid - 1
        return low

    # --- teardown ----------------------------------------------------------------------

    def free(self) -> None:
        """Release every buffer; views taken before dangle. Idempotent."""
        for buffer in self._buffers:
            if buffer.memory is not None:
                buffer.memory.free()
        self._buffers.clear()
        self.layer_views.clear()
        self._num_blocks = 0

    def __repr__(self) -> str:
        mode = "extensible" if self.extensible else "legacy"
        return (
            f"KVCache({mode}, {self._num_blocks}/{self.capacity_blocks} blocks, "
            f"{len(self._buffers)} buffers, {self.committed_bytes} bytes committed)"
        )
