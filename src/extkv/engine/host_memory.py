"""The process's resident memory and its high-water mark, from /proc on Linux.

The CPU has no allocator statistics like CUDA's: a step's peak is the growth of
the resident set's high-water mark (VmHWM) over the step. Linux lets a process
reset that mark (writing 5 to /proc/self/clear_refs), so a peak reached earlier
(loading the weights) does not hide the step's. Elsewhere the mark is
getrusage's, which cannot be reset.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

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
