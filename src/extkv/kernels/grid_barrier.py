"""A barrier across every program of a persistent kernel: kernel boundaries inside one launch.

A decode step's kernels are each a few microseconds long, and a kernel boundary costs
~2 us even with PDL (the next grid waits for the whole previous one to drain and flush,
BENCHMARKS.md 2026-12-05). A persistent kernel runs several of those stages with a
barrier between them instead: every program asks for the next stage's weights first,
then waits at the barrier while they stream in.

The barrier needs every program resident at once, so such a kernel launches at most one
program per SM (`persistent_grid`). Programs of the kernel before may still hold SMs
when it starts; they finish on their own, so the kernel's programs all get one. PDL
lets the kernel after start only once every program of this one has passed
`wait_for_previous_grid`, so it never takes the place of one that has not started.

The Triton interpreter runs programs one after another, so a barrier there would wait
forever: off CUDA a persistent kernel launches once per stage instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from extkv.kernels.arrivals import arrival_counters


@triton.jit
def grid_barrier(state_ptr, num_programs):
    """Wait until all `num_programs` programs got here; their writes before it are then
    visible to every program after it. `state_ptr`: two int32 (arrived, generation),
    zero before the first use; the last program to arrive sets arrived back to zero and
    moves the generation on, so the state needs no reset between barriers or launches."""
    tl.debug_barrier()  # every thread's writes are issued before the program arrives
    generation = tl.atomic_add(state_ptr + 1, 0, sem="acquire")
    if tl.atomic_add(state_ptr, 1, sem="acq_rel") == num_programs - 1:
        tl.atomic_xchg(state_ptr, 0, sem="relaxed")
        tl.atomic_add(state_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(state_ptr + 1, 0, sem="acquire") == generation:
            pass
    tl.debug_barrier()  # no thread reads before the program has seen everyone arrive


def barrier_state(owner: str, device: torch.device) -> torch.Tensor:
    """`owner`'s barrier state (two int32) on `device`: made on first use, outside a
    graph capture, like every arrival counter."""
    return arrival_counters(f"{owner} grid barrier", device, 2)


def one_launch(device: torch.device) -> bool:
    """Whether a persistent kernel runs its stages in one launch with barriers (CUDA),
    or launches once per stage (the interpreter: see the module's docstring)."""
    return device.type == "cuda"


def persistent_grid(work_items: int, num_sms: int) -> int:
    """Programs of a persistent kernel: one per work item of its widest stage, at most one
    per SM so that all of them are resident together (the barrier's condition)."""
    return max(1, min(work_items, num_sms))
