"""Hands out KV cache blocks to sequences from one pool.

A sequence holds attention blocks (`block_size` tokens each) for its block
table and, in models with recurrent (Mamba) layers, one state block per
recurrent group, whatever its length. In hybrid models both kinds come from the
same buffers, so one pool serves them and a block is one kind at a time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from extkv.engine.sequence import Sequence


@dataclass(frozen=True)
class BlockNeeds:
    """What a sequence holds: attention blocks for its tokens (if the model has
    attention) plus one state block per recurrent group."""

    block_size: int
    has_attention: bool = True
    num_state_groups: int = 0

    def blocks_for(self, num_tokens: int) -> int:
        attention = -(-num_tokens // self.block_size) if self.has_attention else 0
        return attention + self.num_state_groups


class BlockManager:
    def __init__(self, num_blocks: int, needs: BlockNeeds) -> None:
        self.num_blocks = num_blocks
        self.needs = needs
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold its first `num_tokens` tokens."""
        held = len(seq.block_table) + len(seq.state_blocks)
        return max(self.needs.blocks_for(num_tokens) - held, 0)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_missing(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{missing} blocks needed, {len(self._free)} free")
        groups = self.needs.num_state_groups
        if groups and not seq.state_blocks:
            seq.state_blocks = [self._free.popleft() for _ in range(groups)]
            missing -= groups
        seq.block_table.extend(self._free.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        self._free.extend(seq.state_blocks)
        seq.block_table = []
        seq.state_blocks = []
