"""ExtensibleTensor: a 1-D uint8 buffer that grows without moving its base pointer.

The whole capacity is reserved as address space up front; physical memory is
committed as the buffer grows. The buffer may be split into equal segments
whose committed prefixes grow in lockstep, which is what a KV cache laid out
as (2, num_blocks, ...) needs: blocks 0..n of K and of V, not the first 2n
blocks of K. Growth never shrinks by mistake: giving memory back is a method of
its own, `shrink_per_segment_`.
"""

from __future__ import annotations

import functools

import torch

from extkv.vmm.backend import Backend, VirtualMemoryError
from extkv.vmm.granules import GranuleMap
from extkv.vmm.host import HostBackend

DeviceLike = str | int | torch.device | None
_DEVICE_CHOICES = (
    '"cuda", "cuda:N", an int N >= 0, a torch.device of type cuda or cpu, "cpu", or None'
)


def resolve_device(device: DeviceLike) -> torch.device:
    """Normalise the accepted device spellings; None means the current CUDA device."""
    if isinstance(device, bool):
        raise ValueError(f"device must be {_DEVICE_CHOICES}; got {device!r}")
    if device is None or isinstance(device, int):
        if isinstance(device, int) and device < 0:
            raise ValueError(f"device must be {_DEVICE_CHOICES}; got {device!r}")
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} asks for CUDA, but no CUDA device is available; "
                'use device="cpu" for the host backend'
            )
        index = torch.cuda.current_device() if device is None else device
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device cuda:{index} does not exist ({torch.cuda.device_count()} CUDA devices)"
            )
        return torch.device("cuda", index)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be {_DEVICE_CHOICES}; got {device!r}") from e
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(f"device must be {_DEVICE_CHOICES}; got {device!r}")
    return resolve_device(resolved.index)


@functools.cache
def _shared_backend(device: torch.device) -> Backend:
    if device.type == "cpu":
        return HostBackend()
    try:  # needs NVIDIA's cuda-bindings, an extra: a CPU-only install goes without
        from extkv.vmm.cuda import CudaBackend
    except ImportError as e:
        raise VirtualMemoryError(
            f"the CUDA virtual-memory backend needs NVIDIA's cuda-bindings ({e}); "
            "install it with: pip install 'extkv[cuda]'"
        ) from e
    return CudaBackend(device.index)


def free_physical_bytes(device: DeviceLike, backend: Backend | None = None) -> int | None:
    """What could be committed on `device` right now (None: unbounded host memory)."""
    return (backend or _shared_backend(resolve_device(device))).free_bytes()


def allocation_granularity(device: DeviceLike, backend: Backend | None = None) -> int:
    """The unit physical memory is mapped in on `device`; raises VirtualMemoryError
    where the device has no virtual memory management."""
    return (backend or _shared_backend(resolve_device(device))).granularity


def _check_size(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value} (negative)")
    return value


class ExtensibleTensor:
    """Reserve `max_num_bytes` of address space, commit a growing prefix of each segment.

    Views returned by `full_view()` and `tensor` keep this object alive; after an
    explicit `free()` they dangle, like any pointer into freed device memory.
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: DeviceLike = None,
        num_segments: int = 1,
        *,
        backend: Backend | None = None,
    ) -> None:
        _check_size("max_num_bytes", max_num_bytes)
        if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
            raise ValueError(f"num_segments must be an int >= 1, got {num_segments!r}")
        if max_num_bytes % num_segments:
            raise ValueError(
                f"max_num_bytes ({max_num_bytes}) must be divisible by "
                f"num_segments ({num_segments})"
            )
        if backend is None:
            backend = _shared_backend(resolve_device(device))
        elif device is not None and resolve_device(device) != backend.device:
            raise ValueError(f"device={device!r} disagrees with the backend's {backend.device}")
        self._backend = backend
        self._max_num_bytes = max_num_bytes
        self._num_segments = num_segments
        self._segment_capacity = max_num_bytes // num_segments
        granularity = backend.granularity
        self._capacity = -(-max_num_bytes // granularity) * granularity
        self._base = backend.reserve(self._capacity) if self._capacity else 0
        self._granules = GranuleMap(backend, self._base, self._capacity // granularity)
        self._bytes_per_segment = 0
        self._freed = False

    # --- sizes -------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device the backend commits memory on."""
        return self._backend.device

    @property
    def base_ptr(self) -> int:
        """Start address of the reservation; fixed for the buffer's life, so views never move."""
        return self._base

    @property
    def num_segments(self) -> int:
        """How many equal segments grow in lockstep (2 for a `split` K/V cache)."""
        return self._num_segments

    @property
    def segment_capacity_bytes(self) -> int:
        """The most one segment can grow to: `max_num_bytes / num_segments`."""
        return self._segment_capacity

    @property
    def capacity_bytes(self) -> int:
        """Address space reserved: `max_num_bytes` rounded up to whole granules."""
        return self._capacity

    @property
    def bytes_per_segment(self) -> int:
        """The usable (committed) prefix of each segment."""
        return self._bytes_per_segment

    @property
    def num_bytes(self) -> int:
        """Usable bytes over all segments; `committed_bytes` can be more (whole granules)."""
        return self._bytes_per_segment * self._num_segments

    @property
    def committed_bytes(self) -> int:
        """Physical bytes mapped: whole granules, so at least `num_bytes`."""
        return self._granules.committed_bytes

    @property
    def num_allocations(self) -> int:
        """Live physical allocations (each one map + one access call)."""
        return self._granules.num_allocations

    # --- views -------------------------------------------------------------------------

    def full_view(self) -> torch.Tensor:
        """All `max_num_bytes`, committed or not; touching an uncommitted byte faults."""
        self._check_alive()
        return self._backend.as_tensor(self._base, self._max_num_bytes, owner=self)

    @property
    def tensor(self) -> torch.Tensor:
        """The committed bytes of a one-segment buffer; take it again after each growth."""
        self._require_single_segment("tensor")
        return self.full_view()[: self._bytes_per_segment]

    # --- growth and shrinking ------------------------------------------------------------

    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> None:
        """Grow every segment's committed prefix to `bytes_per_segment`, keeping old bytes;
        with `zero_new`, zero exactly the newly committed range of each segment."""
        self._check_alive()
        _check_size("bytes_per_segment", bytes_per_segment)
        old = self._bytes_per_segment
        if bytes_per_segment < old:
            raise ValueError(
                f"ExtensibleTensor is grow-only: cannot shrink from {old} to "
                f"{bytes_per_segment} bytes per segment"
            )
        if bytes_per_segment > self._segment_capacity:
            raise ValueError(
                f"{bytes_per_segment} bytes per segment exceeds the segment capacity of "
                f"{self._segment_capacity} bytes"
            )
        if bytes_per_segment == old:
            return
        starts = range(0, self._max_num_bytes, self._segment_capacity)
        new_ranges = [(s + old, s + bytes_per_segment) for s in starts]
        self._granules.commit(new_ranges)
        self._bytes_per_segment = bytes_per_segment
        if zero_new:
            view = self.full_view()
            for start, end in new_ranges:
                view[start:end].zero_()

    def shrink_per_segment_(self, bytes_per_segment: int) -> None:
        """Shrink every segment's committed prefix to `bytes_per_segment`, giving back the
        physical memory of every granule that no kept byte lies in (a granule straddling
        two segments stays while either needs it). The base pointer and the kept bytes
        do not change; bytes past the new prefix are unspecified, and touching one whose
        granule was given back faults."""
        self._check_alive()
        _check_size("bytes_per_segment", bytes_per_segment)
        old = self._bytes_per_segment
        if bytes_per_segment > old:
            raise ValueError(
                f"shrink_per_segment_ cannot grow from {old} to {bytes_per_segment} bytes "
                "per segment; use resize_per_segment_"
            )
        if bytes_per_segment == old:
            return
        self._bytes_per_segment = bytes_per_segment  # even if a driver call fails below
        starts = range(0, self._max_num_bytes, self._segment_capacity)
        self._granules.release_outside([(s, s + bytes_per_segment) for s in starts])

    def resize_(self, num_bytes: int) -> torch.Tensor:
        """Grow a one-segment buffer to `num_bytes` and return the new, longer view."""
        self._require_single_segment("resize_")
        self.resize_per_segment_(num_bytes)
        return self.tensor

    def append(self, num_bytes: int) -> torch.Tensor:
        """Grow a one-segment buffer by `num_bytes` and return the new, longer view."""
        _check_size("num_bytes", num_bytes)
        return self.resize_(self.num_bytes + num_bytes)

    # --- teardown ----------------------------------------------------------------------

    def free(self) -> None:
        """Unmap and release all physical memory, then free the reservation. Idempotent."""
        if self._freed:
            return
        try:
            self._granules.release_all()
        finally:
            if self._capacity:
                self._backend.free_reservation(self._base, self._capacity)
            self._freed = True
            self._bytes_per_segment = 0

    def __del__(self) -> None:
        if getattr(self, "_granules", None) is not None and not self._freed:
            self.free()

    def _check_alive(self) -> None:
        if self._freed:
            raise RuntimeError("ExtensibleTensor was freed")

    def _require_single_segment(self, member: str) -> None:
        if self._num_segments != 1:
            raise ValueError(
                f"{member} needs num_segments == 1 (this buffer has {self._num_segments}); "
                "use full_view() and resize_per_segment_()"
            )

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(device={self.device}, segments={self._num_segments}, "
            f"committed={self.num_bytes}/{self._max_num_bytes} bytes)"
        )
