"""Hands out KV cache blocks to sequences from one pool.

A sequence holds attention blocks (`block_size` tokens each) for its block
table and, in models with recurrent (Mamba) layers, one state block per
recurrent group, whatever its length. In hybrid models both kinds come from the
same buffers, so one pool serves them and a block is one kind at a time.

With a sliding window, a sequence's leading blocks that no later query sees are
released as it runs: their table entries become NO_BLOCK (positions keep their
index), so a long generation holds a window's worth of blocks.

With prefix caching, a full attention block whose KV has been computed is
remembered by its content (its tokens, the images whose embeddings some of its
placeholder tokens stand for, and everything before them). A new
sequence starting with the same tokens takes those blocks instead of computing
them again; blocks are shared by reference count. A freed block keeps its
content until the pool hands it out again, least recently freed first.

The pool can be resized between steps (the KV cache grown or shrunk while
serving): growing adds free blocks; shrinking drops the free blocks past the new
end and moves each held one there to a free block below it, its cached content
too, returning the moves for the caller to copy and to rewrite tables with.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from extkv.engine.sequence import Sequence
from extkv.kv_cache.plan import BlockNeeds

# (hash of the prefix before the block, its tokens, the hashes of the images it holds part of)
BlockKey = tuple[int, tuple[int, ...], tuple[str, ...]]
NO_BLOCK = -1  # a released block's table entry: never read (it is out of every window)


class BlockManager:
    """The pool of KV cache blocks: which sequence holds which, and (with prefix
    caching) which computed blocks can be shared."""

    def __init__(self, num_blocks: int, needs: BlockNeeds, prefix_caching: bool = False) -> None:
        if prefix_caching and needs.num_state_groups:
            raise ValueError(
                "enable_prefix_caching needs a model without Mamba layers: a recurrent "
                "state sums up the whole prefix and cannot be shared block by block"
            )
        if prefix_caching and needs.sliding_window is not None:
            raise ValueError(
                "enable_prefix_caching needs a model without sliding-window attention: "
                "its sequences release the blocks a cached prefix would be made of"
            )
        self.num_blocks = num_blocks
        self.needs = needs
        self.prefix_caching = prefix_caching
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered: oldest first
        self._refs = [0] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self.num_cached_tokens = 0  # prompt tokens served from the cache, for stats
        self._peak_used = 0  # the most blocks held at once since take_peak_used

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds now; free blocks that still cache content do not count."""
        return self.num_blocks - len(self._free)

    # --- prefix caching ------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks a fresh `seq` could start with; at least its last token is left
        to compute, since its logits are needed."""
        if not self.prefix_caching or seq.block_table:
            return []
        size = self.needs.block_size
        blocks: list[int] = []
        parent = 0
        for start in range(0, len(seq) - 1 - size + 1, size):
            block = self._cached.get(key := _block_key(seq, parent, start, size))
            if block is None:
                break
            blocks.append(block)
            parent = hash(key)
        return blocks

    def reuse(self, seq: Sequence, blocks: Seq[int]) -> None:
        """Give `seq` the cached `blocks` as its first ones: their tokens count as computed."""
        for block in blocks:
            self._take(block)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.needs.block_size
        self.num_cached_tokens += seq.num_computed_tokens
        self._peak_used = max(self._peak_used, self.num_used_blocks)
        self.remember_computed(seq)

    def remember_computed(self, seq: Sequence) -> None:
        """Record `seq`'s newly full, computed blocks whose tokens the host knows, by
        content; `seq.block_hashes` carries the chain, so each block is hashed once."""
        if not self.prefix_caching:
            return
        size = self.needs.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else 0
        known = min(seq.num_computed_tokens, len(seq.token_ids))
        for i in range(len(seq.block_hashes), known // size):
            key = _block_key(seq, parent, i * size, size)
            block = seq.block_table[i]
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key
            parent = hash(key)
            seq.block_hashes.append(parent)

    # --- resizing ------------------------------------------------------------------------

    def num_held_from(self, num_blocks: int) -> int:
        """Blocks from `num_blocks` on that some sequence holds: what shrinking there moves."""
        return sum(1 for refs in self._refs[num_blocks:] if refs)

    def num_free_below(self, num_blocks: int) -> int:
        """Free blocks below `num_blocks`: where shrinking there can move blocks to."""
        return sum(1 for block in self._free if block < num_blocks)

    def resize(self, num_blocks: int) -> dict[int, int]:
        """Make the pool `num_blocks` blocks; return {old: new} for every held block that
        moved (those from `num_blocks` on, when shrinking; the caller copies their
        contents and rewrites its tables). Free blocks past the end, and what they cached,
        are forgotten. Raises if the held blocks past the end outnumber the free ones below."""
        if num_blocks >= self.num_blocks:
            self._free.update(dict.fromkeys(range(self.num_blocks, num_blocks)))
            self._refs += [0] * (num_blocks - self.num_blocks)
            self.num_blocks = num_blocks
            return {}
        held = [b for b in range(num_blocks, self.num_blocks) if self._refs[b]]
        room = [b for b in self._free if b < num_blocks]
        if len(held) > len(room):
            raise RuntimeError(
                f"cannot shrink to {num_blocks} blocks: {len(held)} held past it, "
                f"{len(room)} free below it"
            )
        for block in range(num_blocks, self.num_blocks):
            if block in self._free:
                self._forget(block)
                del self._free[block]
        moves = dict(zip(held, room, strict=False))
        for old, new in moves.items():
            self._forget(new)
            del self._free[new]
            self._refs[new] = self._refs[old]
            key = self._key_of.pop(old, None)
            if key is not None:
                self._cached[key] = new
                self._key_of[new] = key
        del self._refs[num_blocks:]
        self.num_blocks = num_blocks
        return moves

    # --- allocation ----------------------------------------------------------------------

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold its first `num_tokens` tokens."""
        held = len(seq.block_table) + len(seq.state_blocks)
        return max(self.needs.blocks_for(num_tokens) - held, 0)

    def blocks_short(self, seq: Sequence, num_tokens: int, reusing: Seq[int] = ()) -> int:
        """Free blocks the pool lacks for `seq` (about to take the cached `reusing` blocks)
        to hold `num_tokens`: 0 when it fits."""
        missing = self.blocks_missing(seq, num_tokens) - len(reusing)
        free = len(self._free) - sum(1 for b in reusing if b in self._free)
        return max(missing - free, 0)

    def can_hold(self, seq: Sequence, num_tokens: int, reusing: Seq[int] = ()) -> bool:
        """Whether `seq` (about to take the cached `reusing` blocks) fits `num_tokens`."""
        return self.blocks_short(seq, num_tokens, reusing) == 0

    def take_peak_used(self) -> int:
        """The most blocks held at once since the last call (what the elastic policy keeps
        committed); the next period starts from what is held now."""
        used = self.num_used_blocks
        peak, self._peak_used = max(self._peak_used, used), used
        return peak

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` the blocks it lacks for `num_tokens` tokens; raises if too few are free."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{missing} blocks needed, {len(self._free)} free")
        groups = self.needs.num_state_groups
        if groups and not seq.state_blocks:
            seq.state_blocks = [self._take_free() for _ in range(groups)]
            missing -= groups
        seq.block_table.extend(self._take_free() for _ in range(missing))
        self._peak_used = max(self._peak_used, self.num_used_blocks)

    def release_out_of_window(self, seq: Sequence) -> None:
        """With a sliding window, free `seq`'s leading blocks that its next query (at
        `num_computed_tokens`) and every later one no longer see. A step already launched
        may still read them, but whatever reuses them writes in a later step."""
        window = self.needs.sliding_window
        if window is None:
            return
        first_seen = max(seq.num_computed_tokens - window + 1, 0) // self.needs.block_size
        first_seen = min(first_seen, len(seq.block_table))
        for i in range(seq.num_released_blocks, first_seen):
            self._drop(seq.block_table[i])
            seq.block_table[i] = NO_BLOCK
        seq.num_released_blocks = max(seq.num_released_blocks, first_seen)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; one left unheld is free but keeps its cached content."""
        held = seq.block_table[seq.num_released_blocks :]
        for block in (*held, *seq.state_blocks):
            self._drop(block)
        seq.block_table = []
        seq.num_released_blocks = 0
        seq.state_blocks = []
        seq.block_hashes = []

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None  # keeps its content until handed out again

    def _take(self, block: int) -> None:
        self._free.pop(block, None)
        self._refs[block] += 1

    def _take_free(self) -> int:
        """The least recently freed block; whatever it held is forgotten."""
        block = next(iter(self._free))
        self._forget(block)
        self._take(block)
        return block

    def _forget(self, block: int) -> None:
        """Drop what `block` caches, if anything."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]


def _block_key(seq: Sequence, parent: int, start: int, size: int) -> BlockKey:
    """The key of `seq`'s block of tokens [start, start + size) after the prefix `parent`."""
    images = tuple(image.hash for image in seq.images_in(start, start + size))
    return parent, tuple(seq.token_ids[start : start + size]), images
