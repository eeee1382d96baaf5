"""Host backend: the same reserve/commit model on ordinary process memory.

`mmap(PROT_NONE)` reserves, `mprotect(READ|WRITE)` commits and
`madvise(DONTNEED)` + `mprotect(PROT_NONE)` releases (the pages leave the
resident set), so touching memory that was never committed, or was given back,
faults exactly as it would on the GPU. Linux only.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from extkv.vmm.backend import VirtualMemoryError, VirtualMemoryOutOfMemory

_PROT_NONE = 0
_MAP_NORESERVE = 0x4000  # Linux
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

HOST_GRANULARITY = 2 << 20  # the CUDA granularity on H100/H200, so both backends behave alike


def _check(result: int, call: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise VirtualMemoryError(f"{call} failed: {os.strerror(errno)} (errno {errno})")


class HostBackend:
    """Process memory with commit semantics; `commit_limit_bytes` caps what may be
    committed at once (a host-side memory budget, reported as out-of-memory)."""

    def __init__(self, commit_limit_bytes: int | None = None) -> None:
        if commit_limit_bytes is not None and commit_limit_bytes < 0:
            raise ValueError(f"commit_limit_bytes must be >= 0 or None, got {commit_limit_bytes}")
        self.device = torch.device("cpu")
        self.granularity = HOST_GRANULARITY
        self.commit_limit_bytes = commit_limit_bytes
        self.committed_bytes = 0

    def reserve(self, size: int) -> int:
        """Reserve inaccessible, unbacked address space with mmap; return its base."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        address = _libc.mmap(None, size, _PROT_NONE, flags, -1, 0)
        if address in (None, _MAP_FAILED):
            errno = ctypes.get_errno()
            raise VirtualMemoryError(f"mmap of {size} bytes failed: {os.strerror(errno)}")
        return address

    def free_reservation(self, address: int, size: int) -> None:
        """munmap a reservation from `reserve`."""
        _check(_libc.munmap(address, size), "munmap")

    def map(self, address: int, size: int) -> object:
        """Make the range read/write, within `commit_limit_bytes`; the size is the handle."""
        limit = self.commit_limit_bytes
        if limit is not None and self.committed_bytes + size > limit:
            raise VirtualMemoryOutOfMemory(
                f"mprotect: committing {size} bytes would exceed the host commit limit "
                f"of {limit} bytes ({self.committed_bytes} committed)"
            )
        _check(_libc.mprotect(address, size, mmap.PROT_READ | mmap.PROT_WRITE), "mprotect")
        self.committed_bytes += size
        return size

    def unmap(self, address: int, size: int, handle: object) -> None:
        """Drop the pages and make the range inaccessible again, so stray accesses fault."""
        _check(_libc.madvise(address, size, mmap.MADV_DONTNEED), "madvise")
        _check(_libc.mprotect(address, size, _PROT_NONE), "mprotect")
        self.committed_bytes -= size

    def unmap_part(
        self, address: int, size: int, handle: object, keep: list[tuple[int, int]]
    ) -> list[object]:
        """Unmap the gaps between the `keep` pieces in place: pages are independent here,
        so the kept ones are never touched (and cost nothing to keep)."""
        start = 0
        for offset, length in [*keep, (size, 0)]:
            if offset > start:
                self.unmap(address + start, offset - start, offset - start)
            start = offset + length
        return [length for _, length in keep]

    def free_bytes(self) -> int | None:
        """Room left under `commit_limit_bytes`, or None when there is no limit."""
        if self.commit_limit_bytes is None:
            return None
        return self.commit_limit_bytes - self.committed_bytes

    def as_tensor(self, address: int, size: int, owner: object) -> torch.Tensor:
        """Zero-copy uint8 CPU tensor over the range, keeping `owner` alive."""
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        array = (ctypes.c_uint8 * size).from_address(address)
        array._owner = owner  # the tensor keeps the array, the array keeps the memory's owner
        return torch.frombuffer(array, dtype=torch.uint8)
