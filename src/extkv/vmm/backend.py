"""The interface both virtual-memory backends (CUDA driver, host mmap) implement.

A backend knows five things: reserve address space, map physical memory onto a
piece of it, unmap that again (wholly, or all but some pieces of it), and wrap an
address range as a torch tensor.
Everything above (granules, segments, growth) is backend-independent and so is
exercised in CI on the host backend.
"""

from __future__ import annotations

from typing import Protocol

import torch


class VirtualMemoryError(RuntimeError):
    """A virtual-memory call failed; the message names the call."""


class VirtualMemoryOutOfMemory(VirtualMemoryError, MemoryError):
    """Physical memory ran out while committing; nothing of the failed call stays mapped."""


class Backend(Protocol):
    """What GranuleMap and ExtensibleTensor need from a device: reserve, map, unmap, wrap."""

    device: torch.device
    granularity: int  # bytes; reservations and mappings are multiples of it

    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of address space; return the base address."""
        ...

    def free_reservation(self, address: int, size: int) -> None:
        """Give back address space from `reserve`; everything in it must be unmapped first."""
        ...

    def map(self, address: int, size: int) -> object:
        """Back [address, address + size) with one physical allocation, readable and
        writable; return a handle for `unmap`. Raises VirtualMemoryOutOfMemory."""
        ...

    def unmap(self, address: int, size: int, handle: object) -> None:
        """Undo one `map` and give its physical memory back."""
        ...

    def unmap_part(
        self, address: int, size: int, handle: object, keep: list[tuple[int, int]]
    ) -> list[object]:
        """Give back the physical memory of one `map` except the `keep` pieces ((offset,
        size) within it, granule-aligned, ascending), which stay mapped at their
        addresses with their contents; return one handle per kept piece. Raises
        VirtualMemoryOutOfMemory, with nothing changed, where that needs memory."""
        ...

    def as_tensor(self, address: int, size: int, owner: object) -> torch.Tensor:
        """A uint8 tensor over [address, address + size) that keeps `owner` alive."""
        ...

    def free_bytes(self) -> int | None:
        """Physical bytes that could be committed now, or None where nothing bounds it."""
        ...
