"""Hands out KV cache blocks to sequences; a block holds `block_size` tokens."""

from __future__ import annotations

from collections import deque

from extkv.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold its first `num_tokens` tokens."""
        return max(-(-num_tokens // self.block_size) - len(seq.block_table), 0)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_missing(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{missing} blocks needed, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
