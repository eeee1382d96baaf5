"""How an attention backend lays out one layer's cache, and how that splits into segments.

A layout names its logical dims (`dims`) and, optionally, the physical order of
those dims (`stride_order`, outermost first). The buffer is contiguous in the
physical order; every dim physically outside the block dim multiplies the
segment count, because each of those slices holds its own run of blocks and
each run must be committed block by block (SPEC section 4).

Mamba state has no backend choice: its page is block-major (see
`mamba_state_views`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from extkv.kv_cache.specs import MambaSpec

# Logical dims a layout may use. `kv` selects K or V; `heads` may be left out for
# single-head caches (MLA's latent).
_DIMS = ("kv", "blocks", "block_size", "heads", "head")
_REQUIRED = ("blocks", "block_size", "head")
_CANONICAL_KV = ("blocks", "block_size", "heads", "head")  # what kv_views returns


@dataclass(frozen=True)
class AttentionLayout:
    """How one layer's attention cache is laid out: logical dims, optionally a physical order."""

    name: str
    dims: tuple[str, ...]
    stride_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        dims = tuple(self.dims)
        unknown = [d for d in dims if d not in _DIMS]
        if unknown:
            raise ValueError(
                f"layout {self.name!r} has dims {unknown}; allowed dims are {_DIMS}. Packed "
                "multi-layer layouts are not supported: a layout describes one layer's cache"
            )
        missing = [d for d in _REQUIRED if d not in dims]
        if missing or len(set(dims)) != len(dims):
            raise ValueError(
                f"layout {self.name!r} dims {dims} must name each of {_REQUIRED} once "
                f"(plus optionally 'kv' and 'heads')"
            )
        object.__setattr__(self, "dims", dims)
        if self.stride_order is not None:
            order = tuple(self.stride_order)
            if sorted(order) != list(range(len(dims))):
                raise ValueError(
                    f"stride_order of layout {self.name!r} must be None or a permutation of "
                    f"{tuple(range(len(dims)))}, got {order}"
                )
            object.__setattr__(self, "stride_order", order)

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The logical shape of a layer's cache in this layout's dims; dims it lacks are dropped."""
        sizes = {
            "kv": 2,
            "blocks": num_blocks,
            "block_size": block_size,
            "heads": num_kv_heads,
            "head": head_size,
        }
        return tuple(sizes[d] for d in self.dims)

    @property
    def block_dim(self) -> int:
        """Which logical dim indexes blocks, the one a cache grows along."""
        return self.dims.index("blocks")

    @property
    def physical_order(self) -> tuple[int, ...]:
        """Dims outermost first in memory; the logical order when no stride order is given."""
        return self.stride_order or tuple(range(len(self.dims)))

    def num_segments(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> int:
        """Runs of blocks in the buffer, each grown on its own: dims physically outside blocks."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        order = self.physical_order
        outer = order[: order.index(self.block_dim)]
        return math.prod(shape[d] for d in outer)

    def view(
        self,
        buffer: torch.Tensor,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
    ) -> torch.Tensor:
        """The layer's cache over a 1-D uint8 `buffer`: logical shape, physical strides."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        order = self.physical_order
        physical = buffer.view(dtype).view([shape[d] for d in order])
        return physical.permute([order.index(d) for d in range(len(shape))])

    def kv_views(self, layer_view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache), each (num_blocks, block_size, num_kv_heads, head_size).

        Without a `kv` dim (MLA) K and V are both the one latent, as one head.
        """
        dims = list(self.dims)
        halves = [layer_view, layer_view]
        if "kv" in dims:
            kv = dims.index("kv")
            halves = [layer_view.select(kv, i) for i in range(2)]
            dims.pop(kv)
        if "heads" not in dims:
            halves = [h.unsqueeze(-1) for h in halves]
            dims.append("heads")
        order = [dims.index(d) for d in _CANONICAL_KV]
        k_cache, v_cache = (h.permute(order) for h in halves)
        return k_cache, v_cache


LAYOUTS = {
    "split": AttentionLayout("split", ("kv", "blocks", "block_size", "heads", "head")),
    "block_major": AttentionLayout("block_major", ("blocks", "kv", "block_size", "heads", "head")),
    "mla": AttentionLayout("mla", ("blocks", "block_size", "head")),
}


def get_layout(name: str) -> AttentionLayout:
    """The named layout (the `kv_layout` option), or an error listing the known names."""
    if name not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {sorted(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


def hybrid_layout(layout: AttentionLayout) -> AttentionLayout:
    """The same logical shape, re-strided so the block dim is physically outermost.

    In a hybrid model attention and Mamba layers share buffers page by page, so
    K and V of block b must lie in one contiguous page (one segment).
    """
    block = layout.block_dim
    order = (block, *(d for d in layout.physical_order if d != block))
    return replace(layout, stride_order=order)


def mamba_state_views(
    buffer: torch.Tensor, spec: MambaSpec, num_blocks: int
) -> tuple[torch.Tensor, ...]:
    """One view per state, each (num_blocks, *state_shape), over a 1-D uint8 `buffer`."""
    pages = buffer.view(num_blocks, spec.page_size_bytes)
    return tuple(
        pages[:, offset : offset + nbytes].view(dtype).view(num_blocks, *shape)
        for offset, nbytes, shape, dtype in zip(
            spec.state_offsets, spec.state_nbytes, spec.shapes, spec.dtypes, strict=True
        )
    )
