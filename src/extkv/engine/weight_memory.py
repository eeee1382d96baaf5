"""The weights in memory that sleep can give back without moving them.

CUDA graphs bake in the weights' addresses, so sleep mode cannot free the weights
and allocate them anew on wake. With `enable_sleep_mode` the engine moves every
parameter and buffer of the model, right after loading and before anything takes
an address, into one ExtensibleTensor: each tensor becomes a view at a fixed
offset of it. Sleep copies bytes out to host memory and shrinks the region to
nothing; wake commits it again under the same base pointer and
copies them back. Level 2 keeps only the buffers on the host (rotary tables and
the like, which no checkpoint holds): on wake the parameters are filled again,
from the checkpoint or by `load_weights` (see extkv.engine.elastic).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from extkv.vmm import ExtensibleTensor

logger = logging.getLogger(__name__)

_ALIGN = 256  # every tensor's start, so that any dtype (and any kernel's vector loads) fits


@dataclass
class _Storage:
    """One storage of the model's tensors: its place in the region, whether a buffer
    (not a parameter) uses it, and its bytes while the region sleeps."""

    offset: int
    num_bytes: int
    has_buffer: bool = False
    saved: torch.Tensor | None = None


def _pinned_host_buffer(num_bytes: int) -> torch.Tensor:
    """`num_bytes` of host memory registered with the driver (page-locked), so copies to
    and from the device run at the link's speed.

    Registered rather than taken from torch's pinned allocator, which rounds a request up
    to a power of two (up to twice the host memory) and keeps it cached."""
    buffer = torch.empty(num_bytes, dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), num_bytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {num_bytes} bytes for the weights' sleep copy failed "
            f"(error {int(err)}): too little host memory to hold the weights while "
            "asleep; free some, or run without enable_sleep_mode"
        )
    return buffer


def _unpin(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class WeightMemory:
    """The model's parameters and buffers as views into one region that can be emptied
    (`offload`) and filled again (`restore`) under the same addresses."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        slots: list[tuple[nn.Module, str, str, torch.Tensor]] = []  # module, kind, name, tensor
        for module in model.modules():
            for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
                slots += [(module, kind, n, t) for n, t in tensors.items() if t is not None]
        self._storages: dict[int, _Storage] = {}  # by the address of the storage before
        sources: dict[int, torch.Tensor] = {}  # a tensor over each of them
        size = 0
        for _, kind, _, tensor in slots:
            key = tensor.untyped_storage().data_ptr()
            if key not in self._storages:
                self._storages[key] = _Storage(size, tensor.untyped_storage().nbytes())
                sources[key] = tensor
                size = -(-(size + self._storages[key].num_bytes) // _ALIGN) * _ALIGN
            self._storages[key].has_buffer |= kind == "buffer"
        self.num_bytes = size
        self._saved: torch.Tensor | None = None  # the whole region while a level-1 sleep lasts
        # On CUDA the host copy a level-1 sleep fills is pinned once, here: pinning runs at
        # about 2 GB/s on the H200's host, 20x slower than the copy itself, and a sleep
        # should cost the copy only (and cannot fail later for lack of lockable memory).
        self._host_copy: torch.Tensor | None = None
        if device.type == "cuda":
            start = time.perf_counter()
            self._host_copy = _pinned_host_buffer(size)
            # Unregistered before the buffer goes back to the heap, whoever drops it: a
            # registered range that is freed makes the next registration there fail.
            self._unpin = weakref.finalize(self, _unpin, self._host_copy.data_ptr())
            logger.info(
                "Pinned %.3f GiB of host memory for level-1 sleep in %.2f s.",
                size / (1 << 30),
                time.perf_counter() - start,
            )
        self._region = ExtensibleTensor(size, device)
        self._region.resize_(size)
        for key, storage in self._storages.items():
            raw = torch.empty(0, dtype=torch.uint8, device=device)
            self._piece(storage).copy_(raw.set_(sources[key].untyped_storage()))
        # Every view before any tensor changes: a tied parameter is listed twice.
        moved = {
            id(t): self._view(t, self._storages[t.untyped_storage().data_ptr()])
            for _, _, _, t in slots
        }
        for module, kind, name, tensor in slots:
            if kind == "param":
                tensor.data = moved[id(tensor)]
            else:
                module._buffers[name] = moved[id(tensor)]
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the storages left behind are not memory in use
        logger.info(
            "Moved the weights into virtual memory that sleep can give back (%.3f GiB).",
            size / (1 << 30),
        )

    def _piece(self, storage: _Storage) -> torch.Tensor:
        """The bytes of `storage` in the region."""
        return self._region.full_view()[storage.offset : storage.offset + storage.num_bytes]

    def _view(self, tensor: torch.Tensor, storage: _Storage) -> torch.Tensor:
        """`tensor` as a view of its storage's copy in the region (same shape and strides)."""
        typed = self._piece(storage).view(tensor.dtype)
        return typed.as_strided(
            tensor.shape, tensor.stride(), typed.storage_offset() + tensor.storage_offset()
        )

    @property
    def committed_bytes(self) -> int:
        """Physical bytes the region holds now: 0 while asleep."""
        return self._region.committed_bytes

    def offload(self, keep_parameters: bool) -> None:
        """Copy what wake needs back to host memory (everything, or with `keep_parameters`
        off only the storages buffers use) and give the region's memory back.

        Everything goes as one copy into one host buffer (on CUDA the one pinned at
        start-up): one transfer at full link speed, where a copy per tensor pays a launch
        and a sync for each."""
        cuda = self._region.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self._region.device)  # no kernel may still read the weights
        if keep_parameters:
            self._saved = self._host_copy
            if self._saved is None:
                self._saved = torch.empty(self.num_bytes, dtype=torch.uint8)
            self._saved.copy_(self._region.full_view()[: self.num_bytes])
        else:
            for storage in self._storages.values():
                if storage.has_buffer:
                    storage.saved = torch.empty(
                        storage.num_bytes, dtype=torch.uint8, pin_memory=cuda
                    )
                    storage.saved.copy_(self._piece(storage))
        self._region.shrink_per_segment_(0)

    def restore(self) -> bool:
        """Commit the region again under the same addresses and copy back what `offload`
        saved; whether the parameters were left out (level 2: their memory is mapped but
        holds nothing yet, for the caller to fill from the checkpoint or `load_weights`)."""
        self._region.resize_(self.num_bytes)
        if self._saved is not None:
            self._region.full_view()[: self.num_bytes].copy_(self._saved)
            self._saved = None
            return False
        for storage in self._storages.values():
            if storage.saved is not None:
                self._piece(storage).copy_(storage.saved)
                storage.saved = None
        return True

    def free(self) -> None:
        """Give the region back for good; the model's tensors dangle after."""
        self._region.free()
        self._saved = None
        if self._host_copy is not None:
            self._unpin()
            self._host_copy = None
        for storage in self._storages.values():
            storage.saved = None
