"""Arrival counters: how a kernel whose programs split one output finishes it without a
second kernel.

Each program of a split tile writes its partial result, then adds one to the tile's
counter; the program that sees the count reach the number of splits is the last, so
every partial is visible to it: it combines them (always in split order, so the bits do
not depend on which program that is) and resets the counter to zero for the next call.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
# Counters replaced by larger ones stay alive: a CUDA graph captured earlier still
# points at them.
_RETIRED: list[torch.Tensor] = []


def arrival_counters(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters of `owner` (one kernel's) on `device`, all zero
    between calls. Made on first use, which must not be inside a graph capture: a
    warm-up call comes first, as for every Triton kernel (it compiles there), and the
    engine captures its largest batch first."""
    counters = _COUNTERS.get((owner, device))
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"run {owner} once before capturing it in a graph")
        if counters is not None:
            _RETIRED.append(counters)
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[(owner, device)] = counters
    return counters
