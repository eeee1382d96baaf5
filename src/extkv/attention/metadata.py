"""What one forward step tells every layer about the batch, per kind of layer.

The model runner builds one `ForwardContext` per step and publishes it with
`set_forward_context`; layers read it with `get_forward_context` and take their
own kind's part (attention layers `.attention[kv_group]`, the metadata of their KV
cache group; Mamba mixers `.mamba`), so model code stays free of paging details (the
nano-vllm pattern) and a new kind of layer adds its own metadata without touching the
others'.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the kernels import Triton; the metadata is also the CPU's
    from extkv.kernels.ssd_prefill import ChunkLayout


@dataclass
class AttentionMetadata:
    """Paged-attention inputs of one step; a batch is all prefill or all decode.

    Token `i` of sequence `s` sits at position `context_lens[s] - q_len(s) + i`,
    where `q_len(s) = cu_seqlens_q[s + 1] - cu_seqlens_q[s]`: the new tokens
    are the tail of the sequence's context, which may start with a cached
    prefix (chunked prefill, prefix caching).

    `key_bounds` (a prefill with images whose tokens attend to each other, Gemma 3):
    the last key position each new token sees, its own or its image's last (a sliding
    window still counts back from its own); None: its own (causal).

    `no_cached_prefix` (a prefill): no sequence continues a cached prefix (every
    `context_lens[s]` is its `q_len(s)`), so every key is one of the step's own tokens;
    known on the host, it lets CUDA attend over the step's K/V without the cache.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 (num_tokens,): cache slot of each new token, -1 = skip
    cu_seqlens_q: torch.Tensor  # int32 (num_seqs + 1,)
    context_lens: torch.Tensor  # int32 (num_seqs,): tokens in the cache after this step
    block_tables: torch.Tensor  # int32 (num_seqs, max_blocks_per_seq), 0 padded
    max_seqlen_q: int
    max_context_len: int
    key_bounds: torch.Tensor | None = None  # int32 (num_tokens,)
    no_cached_prefix: bool = False

    @property
    def num_seqs(self) -> int:
        """Sequences in the step (padding rows of a graph batch included)."""
        return self.context_lens.numel()


@dataclass
class MambaMetadata:
    """What recurrent-state layers need of a step: the sequence boundaries, per state
    group the cache block holding each sequence's state (-1: a padding row, never
    written), and whether that state continues an earlier step (False: zeros)."""

    is_prefill: bool
    cu_seqlens_q: torch.Tensor  # int32 (num_seqs + 1,)
    state_indices: torch.Tensor | None = None  # int32 (num_state_groups, num_seqs)
    has_initial_state: torch.Tensor | None = None  # bool (num_seqs,)
    # A CUDA prefill's chunk layout by chunk size: made by the step's first Mamba layer,
    # read by the others, gone with the step.
    chunk_layouts: dict[int, ChunkLayout] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        """Sequences in the step (padding rows of a graph batch included)."""
        return self.cu_seqlens_q.numel() - 1

    @cached_property
    def host_cu_seqlens(self) -> tuple[int, ...]:
        """`cu_seqlens_q` on the host, read once per step (a prefill's chunked scan cuts
        its chunks there) rather than once per Mamba layer."""
        return tuple(self.cu_seqlens_q.tolist())


@dataclass
class ForwardContext:
    """One step's metadata, one part per kind of layer (None: the step has no such part).

    `attention` has one entry per attention KV cache group (a layer reads the entry its
    `kv_group` names): the groups share everything but their slots and block tables."""

    attention: tuple[AttentionMetadata, ...]
    mamba: MambaMetadata | None = None

    @classmethod
    def packed_prefill(
        cls, lengths: list[int], device: torch.device | str, num_attention_groups: int = 1
    ) -> ForwardContext:
        """A prefill of whole sequences of these lengths, written to no cache: what the
        profiling run (and a test of a model without its KV cache) feeds the layers."""
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        attention = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=device),
            cu_seqlens_q=cu_seqlens,
            context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_tables=torch.zeros(len(lengths), 0, dtype=torch.int32, device=device),
            max_seqlen_q=max(lengths),
            max_context_len=max(lengths),
            no_cached_prefix=True,
        )
        return cls(
            (attention,) * num_attention_groups,
            MambaMetadata(is_prefill=True, cu_seqlens_q=cu_seqlens),
        )


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The context of the step running now (layers call this inside forward)."""
    if _context is None:
        raise RuntimeError("a layer ran outside a forward context (set_forward_context)")
    return _context


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    """Publish `context` to every layer for the duration of one forward pass."""
    global _context
    previous, _context = _context, context
    try:
        yield
    finally:
        _context = previous
