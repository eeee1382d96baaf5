"""The decode step as CUDA graphs, one per batch size, replayed with padding.

A graph bakes in every address it touches, the KV cache's included; that is
why the cache's base pointer must never move once these are captured.

On a machine whose CPU launches kernels slowly, what surrounds the graph
matters as much as the graph: every input of a decode step lives in ONE int32
staging buffer, filled on the host and sent with one copy, and the graph
covers the forward pass, the logits and the greedy argmax. Without CUDA (or
with `capture=False`) the same static path runs eagerly, so the CPU tests
exercise its padding and staging logic.

Under tensor parallelism the driver builds each step's `DecodeInputs` and
sends them to every rank, which stages and replays its own graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from extkv.attention.metadata import AttentionMetadata, set_forward_context
from extkv.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class DecodeInputs:
    """One decode step's inputs, one column per sequence, before padding: the staging
    rows (ids, positions, slots, context lengths, token sources, then the state block
    of each group) and the block tables cut to the longest one. A token source >= 0
    says the input token is still on the device: row `source` of the tokens the
    previous step sampled."""

    rows: np.ndarray  # int32 (5 + num_state_groups, num_seqs)
    tables: np.ndarray  # int32 (num_seqs, width)


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def free_device_memory(device: torch.device) -> int:
    """Free device memory once nothing torch has cached but unused counts as taken."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class DecodeGraphs:
    """Static decode inputs and outputs, plus one captured graph per batch size.

    Padding rows write nothing (slot -1, state row -1) and attend to one token of
    block 0, which both KV cache paths always have committed. `last_tokens` holds the
    previous step's sampled tokens; the graph reads its inputs' pending tokens there.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        block_size: int,
        last_tokens: torch.Tensor,
        num_state_groups: int = 0,
    ) -> None:
        self.model = model
        self.last_tokens = last_tokens
        self.batch_sizes = sorted(batch_sizes)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.capture_graphs = device.type == "cuda"
        n, width = self.batch_sizes[-1], max_blocks_per_seq
        # Rows: ids, positions, slots, context lengths, token sources, then one of state
        # blocks per group.
        num_rows = 5 + num_state_groups
        pinned = self.capture_graphs
        self.host = torch.zeros(num_rows * n + n * width, dtype=torch.int32, pin_memory=pinned)
        self.staging = torch.zeros_like(self.host, device=device)
        self._host_rows = self.host.numpy()[: num_rows * n].reshape(num_rows, n)
        self._host_tables = self.host.numpy()[num_rows * n :].reshape(n, width)
        rows = self.staging[: num_rows * n].view(num_rows, n)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = rows[:4]
        self.token_sources = rows[4]
        self.state_indices = rows[5:] if num_state_groups else None
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)  # decode: always
        self.block_tables = self.staging[num_rows * n :].view(n, width)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        self.greedy_tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Set once the last copy out of the host buffer is done: with asynchronous
        # scheduling the next step is staged while the device may not have read it yet.
        self._sent = torch.cuda.Event() if pinned else None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_seqlen_q=1,
            max_context_len=self.max_model_len,
            state_indices=None if self.state_indices is None else self.state_indices[:, :bs],
            has_initial_state=self.has_initial_state[:bs],
        )

    def _forward(self, bs: int) -> None:
        sources = self.token_sources[:bs]
        pending = self.last_tokens[sources.clamp(min=0)]
        input_ids = torch.where(sources >= 0, pending, self.input_ids[:bs])
        with set_forward_context(self._metadata(bs)):
            hidden = self.model(input_ids, self.positions[:bs])
        logits = self.model.compute_logits(hidden)
        self.logits[:bs] = logits
        self.greedy_tokens[:bs] = logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int] | None = None) -> None:
        """Capture largest first, so smaller graphs reuse its pool memory."""
        self._stage(self.inputs([], []), self.batch_sizes[-1])
        if not self.capture_graphs:
            return
        pool = None
        for bs in sorted(batch_sizes or self.batch_sizes, reverse=True):
            self._forward(bs)  # warm-up: Triton compiles, cuBLAS picks its kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def inputs(self, seqs: list[Sequence], sources: list[int]) -> DecodeInputs:
        """The decode step of `seqs` as host arrays, `sources` as in `DecodeInputs` (built
        as lists and converted once: per-element numpy writes cost more than the rest of
        a step's host work)."""
        num_rows = self._host_rows.shape[0]
        if not seqs:
            return DecodeInputs(np.empty((num_rows, 0), np.int32), np.empty((0, 0), np.int32))
        size = self.block_size
        columns = [
            (
                seq.token_ids[-1],  # stale when pending: the source row replaces it
                len(seq) - 1,
                seq.slot(len(seq) - 1, size),
                len(seq),
                source,
                *seq.state_blocks,
            )
            for seq, source in zip(seqs, sources, strict=True)
        ]
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        return DecodeInputs(
            np.array(columns, dtype=np.int32).T,
            np.array(tables, dtype=np.int32).reshape(len(seqs), width),
        )

    def _stage(self, inputs: DecodeInputs, bs: int) -> None:
        """Write the step's inputs to the host buffer (padding rows up to `bs`), send them."""
        if self._sent is not None:
            self._sent.synchronize()
        rows, tables = self._host_rows, self._host_tables
        n, width = inputs.tables.shape
        rows[:, :n] = inputs.rows
        # Padding: no KV write, one token of block 0, token from the ids row, state
        # row -1 (never written).
        rows[:5, n:bs] = ((0,), (0,), (-1,), (1,), (-1,))
        rows[5:, n:bs] = -1
        tables[:n, :width] = inputs.tables
        tables[:n, width:] = 0
        tables[n:bs] = 0
        self.staging.copy_(self.host, non_blocking=True)
        if self._sent is not None:
            self._sent.record(torch.cuda.current_stream(self.staging.device))

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: (float32 logits, greedy tokens), one row per sequence."""
        n = inputs.rows.shape[1]
        bs = next(s for s in self.batch_sizes if s >= n)
        self._stage(inputs, bs)
        if self.capture_graphs:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.logits[:n], self.greedy_tokens[:n]

    def release(self) -> None:
        self.graphs.clear()
