"""What one block of one layer holds, and so how many bytes a page of it takes.

A spec is layout-free: the same full-attention page can be laid out `split` or
`block_major` (see layouts.py). Specs are frozen so they can key dicts and be
compared when layers are grouped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_dtype(name: str, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name} must be a torch.dtype, got {value!r}")


@dataclass(frozen=True)
class FullAttentionSpec:
    """A block holds K and V of `block_size` tokens."""

    kind: ClassVar[str] = "attention"

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        _check_positive("num_kv_heads", self.num_kv_heads)
        _check_positive("head_size", self.head_size)
        _check_dtype("dtype", self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block: K and V for `block_size` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full-attention pages; only the last `sliding_window` tokens are attended to."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("sliding_window", self.sliding_window)


@dataclass(frozen=True)
class MLASpec:
    """A block holds one latent per token and no K/V split: a single "head"."""

    kind: ClassVar[str] = "attention"
    num_kv_heads: ClassVar[int] = 1

    block_size: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        _check_positive("head_size", self.head_size)
        _check_dtype("dtype", self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block: one latent for `block_size` tokens."""
        return self.block_size * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class MambaSpec:
    """A block holds one sequence's recurrent states (e.g. conv and SSM state).

    The states lie one after another inside the page, so a page is block-major
    and the whole buffer has one segment. `page_size_padded` grows the page to
    the attention page size when the two share buffers in a hybrid model.
    """

    kind: ClassVar[str] = "mamba"

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        if not isinstance(self.shapes, Sequence) or not self.shapes:
            raise ValueError(
                f"shapes must be a non-empty tuple of state shapes, got {self.shapes!r}"
            )
        shapes = tuple(tuple(shape) for shape in self.shapes)
        for shape in shapes:
            for size in shape:
                _check_positive(f"every size in shapes {shapes}", size)
        dtypes = tuple(self.dtypes)
        if len(dtypes) != len(shapes):
            raise ValueError(
                f"dtypes must give one dtype per state: {len(shapes)} shapes, {len(dtypes)} dtypes"
            )
        for dtype in dtypes:
            _check_dtype("every entry of dtypes", dtype)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)

        for offset, dtype in zip(self.state_offsets, dtypes, strict=True):
            if offset % dtype.itemsize:
                raise ValueError(
                    f"state at byte offset {offset} of the page is not aligned to its "
                    f"{dtype} elements; order shapes/dtypes by decreasing itemsize"
                )
        unpadded = self.state_bytes
        padded = self.page_size_padded
        if padded is not None:
            _check_positive("page_size_padded", padded)
            if padded < unpadded:
                raise ValueError(
                    f"page_size_padded must be None or >= the {unpadded} bytes of state, "
                    f"got {padded}"
                )
        page = self.page_size_bytes
        for dtype in dtypes:
            if page % dtype.itemsize:
                raise ValueError(
                    f"page_size_padded ({page}) must be a multiple of every state's itemsize "
                    f"({dtype} has {dtype.itemsize})"
                )

    @property
    def state_nbytes(self) -> tuple[int, ...]:
        """Bytes of each state, in the order they lie in the page."""
        return tuple(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def state_offsets(self) -> tuple[int, ...]:
        """Byte offset of each state inside the page."""
        sizes = self.state_nbytes
        return tuple(sum(sizes[:i]) for i in range(len(sizes)))

    @property
    def state_bytes(self) -> int:
        """Bytes the states need together, before any padding."""
        return sum(self.state_nbytes)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block: the states, or the padded page when shared with attention."""
        return self.state_bytes if self.page_size_padded is None else self.page_size_padded


AttentionSpec = FullAttentionSpec | MLASpec  # SlidingWindowSpec is a FullAttentionSpec
KVCacheSpec = AttentionSpec | MambaSpec
