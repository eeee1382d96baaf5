"""Hands out KV cache blocks to sequences from one pool, one block table per KV cache group.

Each group (extkv.kv_cache.groups) counts its own blocks: an attention group holds a
block per `block_size` tokens, a recurrent (Mamba) group one state block whatever the
length, and a sliding-window group releases the leading blocks that no later query sees
as the sequence runs (their entries become NO_BLOCK, so positions keep their index), so
a long generation holds a window's worth of blocks there while a full-attention group
keeps them all. All groups draw from one pool, a block belonging to one group at a time.

With prefix caching (attention groups, full or sliding window; Mamba state sums up
the whole prefix and is refused), a full block whose KV has been computed is remembered
by its group and its content (its tokens, the images whose embeddings some of its
placeholder tokens stand for, and everything before them): each group caches its own
blocks under the same keys, as vLLM's hybrid KV cache manager does. A new sequence takes
the longest block-aligned prefix [0, L) that every group can serve: a full-attention
group all its blocks, a sliding-window group only those that the query at L still sees
(its earlier entries NO_BLOCK, as if released). Blocks are shared by reference count. A
freed block, released out of a window included, keeps its content until the pool hands
it out again, least recently freed first, so a later prompt can still hit on it.

The pool can be resized between steps (the KV cache grown or shrunk while serving):
growing adds free blocks; shrinking drops the free blocks past the new end and moves
each held one there to a free block below it, its cached content too, rewriting every
holder's tables and returning the moves for the caller to copy.

Every change to a table is also written into `tables` (HostBlockTables), the rows a
step's inputs are gathered from.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from itertools import chain, compress, islice
from operator import not_

from extkv.engine.block_tables import HostBlockTables
from extkv.engine.sequence import Sequence
from extkv.kv_cache.groups import KVCacheGroup

# (hash of the prefix before the block, its tokens, the hashes of the images it holds part of)
BlockKey = tuple[int, tuple[int, ...], tuple[str, ...]]
GroupKey = tuple[int, BlockKey]  # (the group's index, the block's key): one cache entry
NO_BLOCK = -1  # a released block's table entry: never read (it is out of its group's window)


class BlockManager:
    """The pool of KV cache blocks: which sequence holds which, and (with prefix
    caching) which computed blocks can be shared."""

    def __init__(
        self, num_blocks: int, groups: Seq[KVCacheGroup], prefix_caching: bool = False
    ) -> None:
        if not groups:
            raise ValueError("groups must name at least one KV cache group")
        block_sizes = {group.spec.block_size for group in groups}
        if len(block_sizes) != 1:
            raise ValueError(f"groups must share one block_size, got {sorted(block_sizes)}")
        if prefix_caching:
            _check_prefix_caching(groups)
        self.num_blocks = num_blocks
        self.groups = tuple(groups)
        self.block_size = block_sizes.pop()
        self.prefix_caching = prefix_caching
        # The sliding-window groups, by index: where `release_out_of_window` looks.
        self.windowed = [i for i, group in enumerate(groups) if group.sliding_window is not None]
        # Every attention group's table has one length (they all grow with the tokens):
        # one of them tells whether a sequence's tokens fit the blocks it holds.
        self._token_group = next((i for i, group in enumerate(groups) if group.per_token), None)
        # Free blocks are of two kinds. Blocks from `_fresh_from` on have never been handed
        # out since the pool grew over them: they hold nothing, so they go first, and they
        # are only a number, which makes a pool of 872k blocks (or a wake that grows it
        # back) cost nothing to set up. The others, freed by a sequence, may still cache a
        # prefix: least recently freed first, taken from the front, freed to the back.
        # An OrderedDict, not a dict: a dict leaves a dummy entry per key deleted at its
        # front, which every `next(iter(...))` steps over until the next resize, so each
        # take slowed down with the blocks taken before it (bench_block_pool, a pool of 872k
        # blocks: 76 us a block after 100k blocks had gone through, 352 us after 400k).
        self._fresh_from = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._used_by_group = [0] * len(groups)
        self._cached: dict[GroupKey, int] = {}
        self._key_of: dict[int, GroupKey] = {}
        self.num_cached_tokens = 0  # prompt tokens served from the cache, for stats
        self._peak_used = 0  # the most blocks held at once since take_peak_used
        self.tables = HostBlockTables(len(groups))
        self._holders: dict[int, Sequence] = {}  # every sequence holding blocks, by table row

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, whether or not they still cache content."""
        return len(self._free) + self.num_blocks - self._fresh_from

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds now; free blocks that still cache content do not count."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_used_blocks_by_group(self) -> list[int]:
        """Blocks held now in each group, in the order of `groups`."""
        return list(self._used_by_group)

    # --- prefix caching ------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> tuple[list[int], ...]:
        """The cached tables a fresh `seq` could start with, one per group, all of one
        length (the longest prefix every group serves; NO_BLOCK where a window has let go),
        or () for no hit; at least its last token is left to compute, for its logits."""
        if not self.prefix_caching or seq.block_tables:
            return ()
        size, groups = self.block_size, range(len(self.groups))
        found: list[list[int]] = [[] for _ in groups]  # a block or NO_BLOCK per index
        parent = 0
        for start in range(0, len(seq) - size, size):
            key = _block_key(seq, parent, start, size)
            row = [self._cached.get((group, key), NO_BLOCK) for group in groups]
            if any(row[g] == NO_BLOCK for g in groups if g not in self.windowed):
                break  # a full-attention group needs every block before the hit's end
            for table, block in zip(found, row, strict=True):
                table.append(block)
            parent = hash(key)
        length = len(found[0])
        while length and not all(self._window_serves(found[g], g, length) for g in self.windowed):
            length -= 1
        if not length:
            return ()
        hit = tuple(table[:length] for table in found)
        for group in self.windowed:
            out = self.groups[group].num_out_of_window(length * size)
            hit[group][:out] = [NO_BLOCK] * out
        return hit

    def _window_serves(self, found: list[int], group: int, length: int) -> bool:
        """Whether the sliding-window `group` has cached every block among `found`'s first
        `length` that the query at their end still sees."""
        out = self.groups[group].num_out_of_window(length * self.block_size)
        return NO_BLOCK not in found[out:length]

    def reuse(self, seq: Sequence, tables: Seq[Seq[int]]) -> None:
        """Give `seq` the cached `tables` (from `cached_prefix`) as its first blocks in
        each group: their tokens count as computed."""
        for group, table in enumerate(tables):
            for block in table:
                if block != NO_BLOCK:
                    self._take(block, group)
        seq.block_tables = [list(table) for table in tables]
        self._add_holder(seq)
        for group, table in enumerate(seq.block_tables):
            self.tables.extend(seq.table_row, group, 0, table)
        seq.num_released_blocks = [table.count(NO_BLOCK) for table in seq.block_tables]
        seq.num_computed_tokens = len(tables[0]) * self.block_size
        self.num_cached_tokens += seq.num_computed_tokens
        self._peak_used = max(self._peak_used, self.num_used_blocks)
        self.remember_computed(seq)

    def remember_computed(self, seq: Sequence) -> None:
        """Record `seq`'s newly full, computed blocks whose tokens the host knows, in each
        group, by content; `seq.block_hashes` carries the chain, so each block is hashed
        once."""
        if not self.prefix_caching:
            return
        size = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else 0
        known = min(seq.num_computed_tokens, len(seq.token_ids))
        for i in range(len(seq.block_hashes), known // size):
            key = _block_key(seq, parent, i * size, size)
            for group, table in enumerate(seq.block_tables):
                entry = (group, key)
                block = table[i]  # NO_BLOCK if released before its last token was known
                if block != NO_BLOCK and entry not in self._cached and block not in self._key_of:
                    self._cached[entry] = block
                    self._key_of[block] = entry
            parent = hash(key)
            seq.block_hashes.append(parent)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the KV they hold is stale, e.g. new weights came);
        the blocks themselves stay where they are, free or held."""
        self._cached.clear()
        self._key_of.clear()

    # --- resizing ------------------------------------------------------------------------

    def num_held_from(self, num_blocks: int) -> int:
        """Blocks from `num_blocks` on that some sequence holds: what shrinking there moves."""
        tail = self._refs[num_blocks:]
        return len(tail) - tail.count(0)

    def num_free_below(self, num_blocks: int) -> int:
        """Free blocks below `num_blocks`: where shrinking there can move blocks to."""
        past = max(self.num_blocks - num_blocks, 0)
        return self.num_free_blocks - (past - self.num_held_from(num_blocks))

    def resize(self, num_blocks: int) -> dict[int, int]:
        """Make the pool `num_blocks` blocks; return {old: new} for every held block that
        moved (those from `num_blocks` on, when shrinking; the caller copies their
        contents), every holder's tables rewritten with them. Free blocks past the end,
        and what they cached, are forgotten. Raises if the held blocks past the end
        outnumber the free ones below.

        A sleep shrinks the whole pool to 0 and its wake grows it back, so both avoid
        per-block Python work where they can: a grow only adds fresh blocks (a number), a
        shrink's passes over the blocks past the end run in C, and a shrink that frees
        most of the freed blocks makes a new OrderedDict of the rest (`OrderedDict` is
        slow to empty key by key)."""
        if num_blocks >= self.num_blocks:
            self._refs += [0] * (num_blocks - self.num_blocks)
            self.num_blocks = num_blocks
            return {}
        past = range(num_blocks, self.num_blocks)
        held_past = self._refs[num_blocks:]
        held = list(compress(past, held_past))
        # Where they go: fresh blocks below the end first (nothing cached to lose).
        fresh_below = range(self._fresh_from, max(self._fresh_from, num_blocks))
        freed_below = (b for b in self._free if b < num_blocks)
        room = list(islice(chain(fresh_below, freed_below), len(held)))
        if len(held) > len(room):
            raise RuntimeError(
                f"cannot shrink to {num_blocks} blocks: {len(held)} held past it, "
                f"{self.num_free_below(num_blocks)} free below it"
            )
        # Free blocks past the end go, and what they cached (of the fewer: those past the
        # end, or the cached ones).
        key_of = self._key_of
        cached = [b for b in past if b in key_of] if len(past) < len(key_of) else list(key_of)
        for block in cached:
            if block >= num_blocks and not self._refs[block]:
                self._forget(block)
        fresh_taken = min(len(room), len(fresh_below))
        freed_room = room[fresh_taken:]
        # The freed blocks past the end: past it and below the fresh ones, and not held
        # (every held block is below the fresh ones).
        freed_end = max(self._fresh_from, num_blocks)
        gone = freed_end - num_blocks - len(held) + len(freed_room)
        if 2 * gone > len(self._free):  # most of them go: a new dict
            taken = set(freed_room)
            kept = (b for b in self._free if b < num_blocks and b not in taken)
            self._free = OrderedDict.fromkeys(kept if gone < len(self._free) else ())
        else:
            unheld = map(not_, held_past[: freed_end - num_blocks])
            for block in chain(freed_room, compress(range(num_blocks, freed_end), unheld)):
                del self._free[block]
        self._fresh_from = min(self._fresh_from + fresh_taken, num_blocks)
        moves = dict(zip(held, room, strict=True))
        for old, new in moves.items():
            self._forget(new)
            self._refs[new] = self._refs[old]
            key = self._key_of.pop(old, None)
            if key is not None:
                self._cached[key] = new
                self._key_of[new] = key
        del self._refs[num_blocks:]
        self.num_blocks = num_blocks
        if moves:
            for seq in self._holders.values():
                seq.block_tables = [[moves.get(b, b) for b in t] for t in seq.block_tables]
            self.tables.move(moves)
        return moves

    # --- allocation ----------------------------------------------------------------------

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks, over all groups, to hold its first `num_tokens` tokens."""
        return sum(self._missing(seq.block_tables or [[]] * len(self.groups), num_tokens))

    def _missing(self, tables: Seq[Seq[int]], num_tokens: int) -> list[int]:
        """Per group, the blocks `tables` (one per group) lack to hold `num_tokens` tokens."""
        return [
            max(group.blocks_for(num_tokens) - len(table), 0)
            for group, table in zip(self.groups, tables, strict=True)
        ]

    def holds(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s blocks already hold `num_tokens` tokens in every group: the quick
        test of a decode step, which mostly needs no new block."""
        if not seq.block_tables:
            return False
        group = self._token_group
        return group is None or num_tokens <= len(seq.block_tables[group]) * self.block_size

    def blocks_short(self, seq: Sequence, num_tokens: int, reusing: Seq[Seq[int]] = ()) -> int:
        """Free blocks the pool lacks for `seq` (about to take the cached tables `reusing`,
        whose NO_BLOCK entries need no block either) to hold `num_tokens`: 0 when it fits."""
        missing = self.blocks_missing(seq, num_tokens)
        free = self.num_free_blocks
        if reusing:  # a decode's block (every few steps, for every request) reuses none
            missing -= sum(map(len, reusing))
            free -= sum(1 for table in reusing for b in table if b in self._free)
        return max(missing - free, 0)

    def can_hold(self, seq: Sequence, num_tokens: int, reusing: Seq[Seq[int]] = ()) -> bool:
        """Whether `seq` (about to take the cached tables `reusing`) fits `num_tokens`."""
        return self.blocks_short(seq, num_tokens, reusing) == 0

    def take_peak_used(self) -> int:
        """The most blocks held at once since the last call (what the elastic policy keeps
        committed); the next period starts from what is held now."""
        used = self.num_used_blocks
        peak, self._peak_used = max(self._peak_used, used), used
        return peak

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` the blocks it lacks, in every group, for `num_tokens` tokens; raises if
        too few are free (and then takes none)."""
        tables = seq.block_tables or [[] for _ in self.groups]
        missing = self._missing(tables, num_tokens)  # counted once: the check, then the blocks
        needed = sum(missing)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"{needed} blocks needed, {self.num_free_blocks} free")
        if not seq.block_tables:
            seq.block_tables = tables
            seq.num_released_blocks = [0] * len(self.groups)
            self._add_holder(seq)
        for index, (table, count) in enumerate(zip(tables, missing, strict=True)):
            if count:
                taken = [self._take_free(index) for _ in range(count)]
                self.tables.extend(seq.table_row, index, len(table), taken)
                table += taken
        self._peak_used = max(self._peak_used, self.num_used_blocks)

    def release_out_of_window(self, seq: Sequence) -> None:
        """In each sliding-window group, free `seq`'s leading blocks that its next query (at
        `num_computed_tokens`) and every later one no longer see. A step already launched
        may still read them, but whatever reuses them writes in a later step."""
        for index in self.windowed:
            table = seq.block_tables[index]
            released = seq.num_released_blocks[index]
            out = self.groups[index].num_out_of_window(seq.num_computed_tokens)
            first_seen = min(out, len(table))
            if first_seen <= released:
                continue
            for i in range(released, first_seen):
                self._drop(table[i], index)
                table[i] = NO_BLOCK
            self.tables.set(seq.table_row, index, released, [NO_BLOCK] * (first_seen - released))
            seq.num_released_blocks[index] = first_seen

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks in every group; one left unheld is free but keeps
        its cached content."""
        for index, table in enumerate(seq.block_tables):
            for block in table[seq.num_released_blocks[index] :]:
                self._drop(block, index)
        if seq.table_row >= 0:
            self.tables.free_row(seq.table_row, max(map(len, seq.block_tables)))
            del self._holders[seq.table_row]
            seq.table_row = -1
        seq.block_tables = []
        seq.num_released_blocks = []
        seq.block_hashes = []

    def _add_holder(self, seq: Sequence) -> None:
        """`seq` takes its first blocks: a row of the host tables, and a place among the
        holders whose tables `resize` rewrites."""
        seq.table_row = self.tables.add_row()
        self._holders[seq.table_row] = seq

    def _drop(self, block: int, group: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None  # keeps its content until handed out again
            self._used_by_group[group] -= 1

    def _take(self, block: int, group: int) -> None:
        self._free.pop(block, None)
        self._refs[block] += 1
        if self._refs[block] == 1:
            self._used_by_group[group] += 1

    def _take_free(self, group: int) -> int:
        """A fresh block, else the least recently freed one (whatever it held is
        forgotten), for `group`."""
        if self._fresh_from < self.num_blocks:
            block = self._fresh_from
            self._fresh_from += 1
        else:
            block = next(iter(self._free))
            self._forget(block)
        self._take(block, group)
        return block

    def _forget(self, block: int) -> None:
        """Drop what `block` caches, if anything."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]


def _check_prefix_caching(groups: Seq[KVCacheGroup]) -> None:
    """Prefix caching shares attention blocks; refuse models with recurrent state."""
    if any(group.kind == "mamba" for group in groups):
        raise ValueError(
            "enable_prefix_caching needs a model without Mamba layers: a recurrent "
            "state sums up the whole prefix and cannot be shared block by block"
        )


def _block_key(seq: Sequence, parent: int, start: int, size: int) -> BlockKey:
    """The key of `seq`'s block of tokens [start, start + size) after the prefix `parent`."""
    images = tuple(image.hash for image in seq.images_in(start, start + size))
    return parent, tuple(seq.token_ids[start : start + size]), images
