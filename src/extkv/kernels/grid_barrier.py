"""A barrier across every program of a persistent kernel: kernel boundaries inside one launch.

A decode step's kernels are each a few microseconds long, and a kernel boundary costs
~2 us even with PDL (the next grid waits for the whole previous one to drain and flush,
BENCHMARKS.md 2026-12-05). A persistent kernel runs several of those stages with a
barrier between them instead: every program loads its later stages' weights first,
and they stream in while it waits at the barriers.

The barrier needs every program resident at once, so such a kernel launches at most one
program per SM. Programs of the kernel before may still hold SMs
when it starts; they finish on their own, so the kernel's programs all get one. PDL
lets the kernel after start only once every program of this one has passed
`wait_for_previous_grid`, so it never takes the place of one that has not started.
(The kernel assumes the whole GPU: under MPS with fewer SMs than the device reports, its
programs would not all be resident. And one stream: two launches of the same kernel and
grid running at once on two streams would share a barrier counter.)

The Triton interpreter runs programs one after another, so a barrier there would wait
forever: off CUDA a persistent kernel launches once per stage instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grid_barrier(counter_ptr, num_programs):
    """Wait until all `num_programs` programs got here; their writes before it are then
    visible to every program after it.

    `counter_ptr`: an int64 only kernels of `num_programs` programs add to, zero before
    its first use (`barrier_counter`). Each barrier adds `num_programs` to it in all, so
    the barrier a program arrives at is over when the count reaches the next multiple:
    one atomic per program, nothing to reset between barriers or launches."""
    tl.debug_barrier()  # every thread's writes are issued before the program arrives
    arrived = tl.atomic_add(counter_ptr, 1, sem="release")
    done = (arrived // num_programs + 1) * num_programs
    while tl.atomic_add(counter_ptr, 0, sem="acquire") < done:  # an acquiring load
        pass
    tl.debug_barrier()  # no thread reads before the program has seen everyone arrive


_COUNTERS: dict[tuple[str, torch.device, int], torch.Tensor] = {}


def barrier_counter(owner: str, device: torch.device, num_programs: int) -> torch.Tensor:
    """The barrier counter of `owner`'s kernels of `num_programs` programs on `device`
    (see `grid_barrier`): made on first use, which must come before any graph capture
    (the warm-up call that compiles the kernel)."""
    key = (owner, device, num_programs)
    counter = _COUNTERS.get(key)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"run {owner} once before capturing it in a graph")
        counter = _COUNTERS[key] = torch.zeros(1, dtype=torch.int64, device=device)
    return counter


def stage_launches(stages: tuple, device: torch.device) -> list[tuple]:
    """(FIRST, LAST) of each launch of a persistent kernel running `stages` in order: all
    of them in one launch on CUDA, one stage a launch in the interpreter (see above)."""
    if device.type == "cuda":
        return [(stages[0], stages[-1])]
    return [(stage, stage) for stage in stages]
