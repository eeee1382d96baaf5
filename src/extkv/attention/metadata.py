"""What one forward step tells every attention layer about the batch.

The model runner fills one `AttentionMetadata` per step and publishes it with
`set_forward_context`; attention layers read it with `get_forward_context`, so
model code stays free of paging details (the nano-vllm pattern).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Paged-attention inputs of one step; a batch is all prefill or all decode.

    Token `i` of sequence `s` sits at position `context_lens[s] - q_len(s) + i`,
    where `q_len(s) = cu_seqlens_q[s + 1] - cu_seqlens_q[s]`: the new tokens
    are the tail of the sequence's context, which may start with a cached
    prefix (chunked prefill, prefix caching).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 (num_tokens,): cache slot of each new token, -1 = skip
    cu_seqlens_q: torch.Tensor  # int32 (num_seqs + 1,)
    context_lens: torch.Tensor  # int32 (num_seqs,): tokens in the cache after this step
    block_tables: torch.Tensor  # int32 (num_seqs, max_blocks_per_seq), -1 padded
    max_seqlen_q: int
    max_context_len: int
    # Recurrent-state layers (Mamba): per state group, the cache block holding each
    # sequence's state (-1: a padding row, never written), and whether that state
    # continues an earlier step (False: start from zeros).
    state_indices: torch.Tensor | None = None  # int32 (num_state_groups, num_seqs)
    has_initial_state: torch.Tensor | None = None  # bool (num_seqs,)

    @classmethod
    def packed_prefill(cls, lengths: list[int], device: torch.device | str) -> AttentionMetadata:
        """A prefill of whole sequences of these lengths, written to no cache: what the
        profiling run (and a test of a model without its KV cache) feeds attention."""
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cls(
            is_prefill=True,
            slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_tables=torch.zeros(len(lengths), 0, dtype=torch.int32, device=device),
            max_seqlen_q=max(lengths),
            max_context_len=max(lengths),
        )

    @property
    def num_seqs(self) -> int:
        return self.context_lens.numel()


_context: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    if _context is None:
        raise RuntimeError("attention ran outside a forward context (set_forward_context)")
    return _context


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _context
    previous, _context = _context, metadata
    try:
        yield
    finally:
        _context = previous
