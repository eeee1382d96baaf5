"""CUDA graphs of the decode step, one per batch size, replayed with padding.

A graph bakes in every address it touches, the KV cache's included; that is
why the cache's base pointer must never move once these are captured.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from extkv.attention.metadata import AttentionMetadata, set_forward_context

logger = logging.getLogger(__name__)


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def free_device_memory(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


class DecodeGraphs:
    """Static input buffers plus one captured graph per decode batch size.

    Padding rows write nothing (slot -1) and attend to one token of block 0,
    which both KV cache paths always have committed.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.batch_sizes = sorted(batch_sizes)
        self.max_model_len = max_model_len
        n = self.batch_sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, **i32)
        self.cu_seqlens_q = torch.arange(n + 1, **i32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_seqlen_q=1,
            max_context_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self, batch_sizes: list[int] | None = None) -> None:
        """Capture largest first so smaller graphs reuse its pool memory."""
        pool = None
        for bs in sorted(batch_sizes or self.batch_sizes, reverse=True):
            with set_forward_context(self._metadata(bs)):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = pool or graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        n = input_ids.numel()
        bs = next(s for s in self.batch_sizes if s >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = metadata.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = metadata.context_lens
        self.context_lens[n:bs] = 1
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width] = metadata.block_tables
        self.block_tables[n:bs] = 0
        self.graphs[bs].replay()
        return self.hidden[:n]

    def release(self) -> None:
        self.graphs.clear()
