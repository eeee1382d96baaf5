"""CUDA backend: the driver's virtual memory management API via `cuda-bindings`.

Every driver result is checked; a failure raises an error naming the call and
the driver's own message. Calls run inside the device's primary context (the
one torch uses too), pushed for the call and popped after, so this works
whether or not torch has touched CUDA yet and never disturbs the caller's
current context.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from cuda.bindings import driver as cu

from extkv.vmm.backend import VirtualMemoryError, VirtualMemoryOutOfMemory

logger = logging.getLogger(__name__)


def _error_text(err: cu.CUresult) -> str:
    _, name = cu.cuGetErrorName(err)
    _, text = cu.cuGetErrorString(err)
    decode = lambda b: b.decode() if isinstance(b, bytes) else str(b)  # noqa: E731
    return f"{decode(name)}: {decode(text)}"


def _check(result: tuple[Any, ...], call: str) -> Any:
    """Unpack a driver result `(err, *values)`, raising on any error."""
    err, *values = result
    if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        raise VirtualMemoryOutOfMemory(f"{call} failed: {_error_text(err)}")
    if err != cu.CUresult.CUDA_SUCCESS:
        raise VirtualMemoryError(f"{call} failed: {_error_text(err)}")
    return values[0] if len(values) == 1 else tuple(values) or None


def _check_in_cleanup(result: tuple[Any, ...], call: str) -> None:
    """Undoing a failed map: report a second failure, but let the first one propagate."""
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        logger.error("%s failed while undoing a failed map: %s", call, _error_text(result[0]))


class _DeviceArray:
    """The smallest object torch can wrap zero-copy: a CUDA array interface."""

    def __init__(self, address: int, size: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


class CudaBackend:
    """Backend over the CUDA driver's VMM calls on one device, run in its primary context."""

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)
        _check(cu.cuInit(0), "cuInit")
        device = _check(cu.cuDeviceGet(index), "cuDeviceGet")
        supported = _check(
            cu.cuDeviceGetAttribute(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                device,
            ),
            "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)",
        )
        if not supported:
            raise VirtualMemoryError(f"cuda:{index} does not support virtual memory management")
        self._cu_device = device
        self._context = _check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")

        self._prop = cu.CUmemAllocationProp()
        self._prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.granularity = int(
            _check(
                cu.cuMemGetAllocationGranularity(
                    self._prop,
                    cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                ),
                "cuMemGetAllocationGranularity",
            )
        )

    @contextmanager
    def _in_context(self) -> Iterator[None]:
        _check(cu.cuCtxPushCurrent(self._context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def reserve(self, size: int) -> int:
        """Reserve device address space (no physical memory yet); return its base."""
        with self._in_context():
            pointer = _check(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
        return int(pointer)

    def free_reservation(self, address: int, size: int) -> None:
        """Free address space from `reserve`; its mappings must be gone already."""
        with self._in_context():
            _check(cu.cuMemAddressFree(address, size), "cuMemAddressFree")

    def map(self, address: int, size: int) -> object:
        """One physical allocation mapped read/write at `address`; all undone on failure."""
        with self._in_context():
            handle = _check(cu.cuMemCreate(size, self._prop, 0), "cuMemCreate")
            try:
                _check(cu.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
                try:
                    _check(cu.cuMemSetAccess(address, size, [self._access], 1), "cuMemSetAccess")
                except BaseException:
                    _check_in_cleanup(cu.cuMemUnmap(address, size), "cuMemUnmap")
                    raise
            except BaseException:
                _check_in_cleanup(cu.cuMemRelease(handle), "cuMemRelease")
                raise
        return handle

    def unmap(self, address: int, size: int, handle: object) -> None:
        """Unmap a range from `map` and release its physical allocation."""
        with self._in_context():
            _check(cu.cuMemUnmap(address, size), "cuMemUnmap")
            _check(cu.cuMemRelease(handle), "cuMemRelease")

    def unmap_part(
        self, address: int, size: int, handle: object, keep: list[tuple[int, int]]
    ) -> list[object]:
        """Release one mapping but the `keep` pieces, whose bytes move to allocations of
        their own under the same addresses.

        The driver cannot give back part of a physical allocation: `cuMemUnmap` takes
        a whole mapping and `cuMemRelease` a whole handle. So each kept piece gets a
        new allocation, mapped first at a scratch reservation and filled by a device
        copy while the old mapping still stands; then the old allocation is unmapped
        and released, and each new one is moved (unmapped from scratch, mapped again)
        to its piece's address. For a moment this holds the kept bytes twice: out of
        memory for the copies raises VirtualMemoryOutOfMemory with nothing changed.
        The device is synchronised first, since kernels may still use the range.
        """
        scratch_size = sum(length for _, length in keep)
        with self._in_context():
            _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            scratch = self.reserve(scratch_size)
            copies: list[tuple[object, int, int, int]] = []  # handle, scratch, offset, size
            try:
                at = scratch
                for offset, length in keep:
                    copies.append((self.map(at, length), at, offset, length))
                    _check(cu.cuMemcpyDtoD(at, address + offset, length), "cuMemcpyDtoD")
                    at += length
                _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            except BaseException:
                for new, at, _, length in copies:
                    self.unmap(at, length, new)
                self.free_reservation(scratch, scratch_size)
                raise
            self.unmap(address, size, handle)
            for new, at, offset, length in copies:
                _check(cu.cuMemUnmap(at, length), "cuMemUnmap")  # `new` keeps the memory
                _check(cu.cuMemMap(address + offset, length, 0, new, 0), "cuMemMap")
                _check(
                    cu.cuMemSetAccess(address + offset, length, [self._access], 1),
                    "cuMemSetAccess",
                )
            self.free_reservation(scratch, scratch_size)
        return [new for new, _, _, _ in copies]

    def free_bytes(self) -> int | None:
        """Free device memory per the driver: what a commit could still get."""
        with self._in_context():
            free, _total = _check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def as_tensor(self, address: int, size: int, owner: object) -> torch.Tensor:
        """Zero-copy uint8 CUDA tensor over the range, keeping `owner` alive."""
        if size == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.as_tensor(_DeviceArray(address, size, owner), device=self.device)
