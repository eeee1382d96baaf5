"""Programmatic dependent launch (PDL): the decode step's kernels start before the
previous one has finished.

A decode step's CUDA graph is a few hundred kernels of a few microseconds each;
without PDL each one is launched only once the one before has drained and flushed
its writes. On Hopper (sm90+) a kernel launched with PDL starts while the previous
grid ends: its programs do what needs no result of that grid (a GEMV prefetches
its weight slice into L2), then `wait_for_previous_grid` blocks until the previous
grid's writes are visible, and lets the next kernel start in turn. Every Triton
kernel of the step calls it before it reads or writes any activation (a buffer the
graph's memory pool may share with the kernel before), so at most two grids
overlap and the results are those of serial launches.

On by default on sm90+ (`EXTKV_PDL=0` launches serially): in one run on the H200
a Qwen3-0.6B-shaped batch-1 decode step took 1.030 ms with it against 1.161 ms
without, batch 256 the same (BENCHMARKS.md); `scripts/gpu-check step-serial`
measures the serial launches beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@functools.cache
def _pdl_supported(device: torch.device) -> bool:
    wanted = os.environ.get("EXTKV_PDL", "1")
    if wanted not in ("0", "1"):
        raise ValueError(f"EXTKV_PDL must be 0 (serial launches) or 1 (PDL), got {wanted!r}")
    if device.type != "cuda" or wanted == "0":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    has_option = "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
    return has_option and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict[str, Any]:
    """The launch keywords of a kernel that takes `USE_PDL: tl.constexpr` and calls
    `wait_for_previous_grid(USE_PDL)`: PDL on sm90+ CUDA unless EXTKV_PDL=0, a serial
    launch otherwise (the CPU's Triton interpreter included)."""
    if _pdl_supported(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def wait_for_previous_grid(USE_PDL: tl.constexpr):
    """Block until the previous kernel's writes are visible, then let the next kernel
    launch (its programs wait here in turn). A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(addresses):
    """Ask L2 for the 128-byte lines at `addresses` (int64 byte addresses), without
    waiting for them: for data no earlier kernel writes (weights), before the wait."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0 unused",
        "=r,l",
        [addresses],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
