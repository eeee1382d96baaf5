"""Layers split over the tensor-parallel ranks, each loading only its shard.

Column-parallel layers hold a slice of the output features (q/k/v by heads,
gate/up by rows) and need no communication; row-parallel layers hold the
matching slice of the input features and sum their partial outputs
(all-reduce). A column-parallel layer followed by a row-parallel one
(attention, MLP, Mamba mixer) costs one all-reduce. The embedding and the LM
head split the vocabulary, padded up to a multiple of the ranks.

Shard sizes come from the group the model is built in (`use_group`); weight
loaders cut this rank's rows out of the full checkpoint tensor. With one rank
every shard is the whole tensor and each layer is its plain torch counterpart.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from extkv.distributed import current_group
from extkv.models import ops

WeightLoader = Callable[[nn.Parameter, torch.Tensor, str | None], None]


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of a checkpoint tensor of `total` rows; rows past
    `total` (the padded vocabulary) are zeros."""

    start: int
    size: int
    total: int


def split_evenly(count: int, what: str, unit: int = 1) -> Shard:
    """This rank's 1/size of `count` units (heads, channels) of `unit` rows each."""
    tp = current_group()
    if count % tp.size:
        raise ValueError(f"tensor_parallel_size={tp.size} must divide {what} ({count})")
    per_rank = count // tp.size
    return Shard(tp.rank * per_rank * unit, per_rank * unit, count * unit)


def split_heads(count: int, what: str, unit: int) -> Shard:
    """Like `split_evenly`, but with fewer heads than ranks each head is replicated
    on size / count ranks (KV heads under grouped-query attention)."""
    tp = current_group()
    if count < tp.size and tp.size % count == 0:
        return Shard(tp.rank * count // tp.size * unit, unit, count * unit)
    if count % tp.size:
        raise ValueError(
            f"tensor_parallel_size={tp.size} must divide {what} ({count}) or be a multiple of it"
        )
    return split_evenly(count, what, unit)


def split_vocab(vocab_size: int) -> Shard:
    """ceil(vocab / size) rows per rank; the last rank's tail is padding."""
    tp = current_group()
    per_rank = -(-vocab_size // tp.size)
    return Shard(tp.rank * per_rank, per_rank, vocab_size)


def stacked(sections: Sequence[Shard]) -> list[Shard]:
    """The shards of sections stored one after another in one checkpoint tensor
    (Mamba's in_proj: gate, x, B, C, dt), each section split on its own."""
    total = sum(s.total for s in sections)
    starts = itertools.accumulate(s.total for s in sections[:-1])
    return [
        Shard(start + s.start, s.size, total)
        for start, s in zip((0, *starts), sections, strict=True)
    ]


def load_shards(
    dst: torch.Tensor, loaded: torch.Tensor, shards: Sequence[Shard], dim: int = 0
) -> None:
    """Copy `shards` of `loaded` (along `dim`) into `dst` one after another, casting dtype."""
    full = (*dst.shape[:dim], shards[0].total, *dst.shape[dim + 1 :])
    if tuple(loaded.shape) != full:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {full}")
    offset = 0
    for s in shards:
        present = max(min(s.size, s.total - s.start), 0)
        dst.narrow(dim, offset, present).copy_(loaded.narrow(dim, s.start, present))
        dst.narrow(dim, offset + present, s.size - present).zero_()
        offset += s.size


def shard_loader(*shards: Shard, dim: int = 0) -> WeightLoader:
    """A weight loader that copies this rank's `shards` (along `dim`) of a checkpoint tensor."""

    def load(param: nn.Parameter, loaded: torch.Tensor, part: str | None) -> None:
        load_shards(param.data, loaded, shards, dim)

    return load


def sharded(param: nn.Parameter, *shards: Shard) -> nn.Parameter:
    """`param`, loaded from the rows `shards` of its checkpoint tensor."""
    param.weight_loader = shard_loader(*shards)
    return param


class ColumnParallelLinear(nn.Linear):
    """Output features split over the ranks: this rank's rows of every part, one matmul.

    `parts` maps each checkpoint tensor that fills this layer (None: the layer's
    own) to the shards of it this rank holds, stacked in that order.
    """

    def __init__(self, in_features: int, parts: dict[str | None, list[Shard]], bias: bool) -> None:
        placed, rows = {}, 0
        for name, shards in parts.items():
            placed[name] = (rows, shards)
            rows += sum(s.size for s in shards)
        super().__init__(in_features, rows, bias=bias)
        self.parts = placed
        for param in self.parameters():
            param.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """nn.Linear's, through `ops.linear`: a decode step's rows take the GEMV on CUDA."""
        return ops.linear(x, self.weight, self.bias)

    def normed(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: nn.Module,
        one_row: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer of `norm(x, residual)`'s output, the residual stream): the RMSNorm
        before the projection fused into a decode step's GEMV (`ops.rms_norm_linear`;
        `one_row`: its one-row kernel for one row)."""
        return ops.rms_norm_linear(
            x, residual, norm.weight, norm.eps, self.weight, self.bias, one_row=one_row
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: str | None) -> None:
        """Copy this rank's shards of checkpoint tensor `part` into its rows of `param`."""
        offset, shards = self.parts[part]
        rows = sum(s.size for s in shards)
        load_shards(param.data.narrow(0, offset, rows), loaded, shards)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Projections that checkpoints keep as sibling modules (q/k/v, gate/up), fused into
    one matmul; the keys of `parts` are the siblings' names, which the loader maps."""


class RowParallelLinear(nn.Linear):
    """Input features split over the ranks (`shard`, the preceding column-parallel
    layer's output); the partial products are summed, the bias added once."""

    def __init__(self, shard: Shard, out_features: int, bias: bool) -> None:
        super().__init__(shard.size, out_features, bias=bias)
        self.tp = current_group()
        self.weight.weight_loader = shard_loader(shard, dim=1)

    def forward(self, x: torch.Tensor, gated: bool = False, reduce: bool = True) -> torch.Tensor:
        """This rank's partial product, summed over the ranks (the bias on rank 0 only);
        `reduce` False leaves the sum to the caller, who adds other partials first.
        `gated`: x is a gated MLP's (T, 2 in_features), gate then up, and the layer takes
        silu(gate) * up, fused into a decode step's GEMV (`ops.silu_and_mul_linear`)."""
        bias = self.bias if self.tp.rank == 0 else None
        y = (
            ops.silu_and_mul_linear(x, self.weight, bias)
            if gated
            else ops.linear(x, self.weight, bias)
        )
        return self.tp.all_reduce(y) if reduce else y


class VocabParallelEmbedding(nn.Embedding):
    """Each rank embeds the tokens of its vocabulary rows, zeros for the others; the
    all-reduce assembles every row from the one rank that has it."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        shard = split_vocab(num_embeddings)
        super().__init__(shard.size, embedding_dim)
        self.tp = current_group()
        self.shard = shard
        sharded(self.weight, shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of `input_ids`; under tensor parallelism assembled across the ranks."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary rows, gathered from every rank; the weight may
    be tied to a `VocabParallelEmbedding`, which has the same rows."""

    def __init__(self, in_features: int, vocab_size: int) -> None:
        shard = split_vocab(vocab_size)
        super().__init__(in_features, shard.size, bias=False)
        self.tp = current_group()
        self.vocab_size = vocab_size
        sharded(self.weight, shard)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, in_features) -> (n, vocab_size) in the weight's dtype; a decode step's few
        rows by the GEMV (`ops.linear`), which streamed Qwen3's 311 MB head in 100 us at
        one row on an H100 where cuBLAS took 105 (BENCHMARKS.md, 2026-12-05 session 7)."""
        return self.tp.all_gather(ops.linear(hidden, self.weight))[:, : self.vocab_size]
