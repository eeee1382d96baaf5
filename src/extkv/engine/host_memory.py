"""The process's resident memory and its high-water mark, from /proc on Linux, and the C
allocator's hold on freed memory.

The CPU has no allocator statistics like CUDA's: a step's peak is the growth of
the resident set's high-water mark (VmHWM) over the step. Linux lets a process
reset that mark (writing 5 to /proc/self/clear_refs), so a peak reached earlier
(loading the weights) does not hide the step's. Elsewhere the mark is
getrusage's, which cannot be reset.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """The resident set now (its high-water mark where /proc is missing)."""
    rss = _status_bytes("VmRSS")
    return peak_resident_bytes() if rss is None else rss


def peak_resident_bytes() -> int:
    """The resident set's high-water mark since the start or the last reset."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, else kB


def reset_peak_resident() -> bool:
    """Set the high-water mark to the resident set now; False where it cannot be reset."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


# glibc's mallopt parameters, and the largest mmap threshold it accepts (64-bit).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MAX_MMAP_THRESHOLD = 32 << 20
_INT_MAX = (1 << 31) - 1
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory(limit_bytes: int) -> bool:
    """Have glibc's malloc keep freed blocks for reuse, up to `limit_bytes` of them: by
    default it gives the heap's free top back to the OS and maps blocks over a threshold
    fresh, so each CPU step's activations are page-faulted in again (a 2000-token prefill
    took 0.1-0.6 M faults, 5-15% of its time). Blocks up to 32 MiB (glibc's cap) then come
    from the heap. False where the C library is not glibc or the user tuned malloc (its
    environment variables)."""
    tuned = "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    if tuned or any(name in os.environ for name in _MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own C library
    except (OSError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: other parameters, or none
        return False
    kept = libc.mallopt(_M_TRIM_THRESHOLD, min(limit_bytes, _INT_MAX))
    mapped = libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD)
    if kept and mapped:
        logger.info("malloc keeps up to %.2f GiB of freed memory.", limit_bytes / (1 << 30))
    return bool(kept and mapped)
