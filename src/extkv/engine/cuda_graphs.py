"""The decode step as CUDA graphs, one per batch size, replayed with padding.

A graph bakes in every address it touches, the KV cache's included; that is
why the cache's base pointer must never move once these are captured. The
step's inputs come from the runner's persistent input buffers (see
extkv.engine.step_inputs), staged with one copy, and the graph covers the
forward pass, the logits and the greedy argmax. Without CUDA the same
padded path runs eagerly, so the CPU tests exercise its padding and staging.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """Sizes to capture: 1, 2, 4, 8, every 16, and `max_num_seqs`, so padding stays small."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def free_device_memory(device: torch.device) -> int:
    """Free device memory once nothing torch has cached but unused counts as taken."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class DecodeGraphs:
    """One captured graph of `decode(bs)` per batch size (CUDA); elsewhere `decode` runs
    as it is. `decode(bs)` must read and write only persistent tensors; `pad(bs)` stages
    a batch of `bs` padding rows (which write nothing) for the capture to run on."""

    def __init__(
        self,
        batch_sizes: list[int],
        decode: Callable[[int], None],
        pad: Callable[[int], None],
        device: torch.device,
    ) -> None:
        self.batch_sizes = sorted(batch_sizes)
        self._decode = decode
        self._pad = pad
        self._capture = device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def padded_size(self, num_seqs: int) -> int:
        """The batch size a decode of `num_seqs` sequences runs at."""
        return next(s for s in self.batch_sizes if s >= num_seqs)

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int] | None = None) -> None:
        """Capture largest first, so smaller graphs reuse its pool memory. Without CUDA
        only the warm-ups of the two smallest sizes run: nothing compiles or is captured
        there, so they only show the CPU tests that staging one size after another
        writes nothing (every size costs the CPU a whole decode step)."""
        pool = None
        sizes = sorted(batch_sizes or self.batch_sizes, reverse=True)
        for bs in sizes if self._capture else sizes[-2:]:
            # The buffers' layout depends on the batch size: stage this size's padding,
            # or the warm-up reads another size's rows as slots and state blocks.
            self._pad(bs)
            self._decode(bs)  # warm-up: Triton compiles, cuBLAS picks its kernels
            if not self._capture:
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._decode(bs)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
        if self._capture:
            torch.cuda.synchronize()

    def run(self, bs: int) -> None:
        """Decode the staged inputs at padded size `bs`: a replay on CUDA, eager elsewhere."""
        if self._capture:
            self.graphs[bs].replay()
        else:
            self._decode(bs)

    def release(self) -> None:
        """Drop the graphs so that their memory pool can go back to the device."""
        self.graphs.clear()
