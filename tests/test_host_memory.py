"""The C allocator's hold on freed memory on the CPU: a step's activations, freed at its
end, are the next step's without the OS faulting their pages in again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

# A step's activations: 6 blocks of 8 MiB alive together, then freed (malloc'd directly:
# a tensor's small allocations, placed between them or not, would make glibc's default
# vary). By default glibc gives the heap's free top back to the OS past twice its mmap
# threshold, which the first free set to 8 MiB: every step faults its pages in again.
STEP = """
import ctypes, resource

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def step():
    activations = [libc.malloc(8 << 20) for _ in range(6)]
    for block in activations:
        ctypes.memset(block, 1, 8 << 20)
    for block in activations:
        libc.free(block)

for _ in range(4):  # the heap grows to the step's peak
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
KEEP = """
from extkv.engine.host_memory import keep_freed_memory

assert keep_freed_memory(1 << 30) is {kept}
"""
ENGINE = """
from extkv import LLM

LLM({folder!r}, device="cpu", max_model_len=64, max_num_seqs=4)
"""
STEP_PAGES = 2 * 6 * (8 << 20) // os.sysconf("SC_PAGE_SIZE")


def page_faults(setup: str, env: dict[str, str] | None = None) -> int:
    """The minor page faults of two steps after `setup`, in a fresh process: malloc's
    settings are the whole process's."""
    done = subprocess.run(
        [sys.executable, "-c", setup + STEP],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


@glibc_only
def test_steps_reuse_freed_memory_unless_the_user_tuned_malloc() -> None:
    assert page_faults(KEEP.format(kept=True)) < STEP_PAGES // 100
    # A malloc setting of the user's (here one that changes nothing: glibc's default
    # tcache) is left alone, and glibc's default faults the steps in again.
    tuned = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}
    assert page_faults(KEEP.format(kept=False), tuned) > STEP_PAGES // 2


@glibc_only
def test_an_engine_on_the_cpu_keeps_freed_memory(qwen3: Path) -> None:
    assert page_faults(ENGINE.format(folder=str(qwen3))) < STEP_PAGES // 100
