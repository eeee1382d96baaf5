"""Virtual memory: reserve address space once, commit physical memory as needed."""

from extkv.vmm.backend import VirtualMemoryError, VirtualMemoryOutOfMemory
from extkv.vmm.host import HostBackend
from extkv.vmm.tensor import (
    ExtensibleTensor,
    allocation_granularity,
    free_physical_bytes,
    resolve_device,
)

__all__ = [
    "ExtensibleTensor",
    "HostBackend",
    "VirtualMemoryError",
    "VirtualMemoryOutOfMemory",
    "allocation_granularity",
    "free_physical_bytes",
    "resolve_device",
]
