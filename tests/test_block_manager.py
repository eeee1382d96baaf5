"""BlockManager alone, no model: a block table per KV cache group (attention, sliding
window, recurrent state) drawn from one pool, each group counting its own blocks;
prefix caching by content, shared by reference count, forgotten when the pool hands a
block out again; the pool resized (held blocks moved below a new end, their cached
content with them); and random add/grow/compute/free/resize runs that never leak or
share a block they should not."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extkv.engine.block_manager import NO_BLOCK, BlockManager
from extkv.engine.sequence import Sequence
from helpers import kv_groups, make_sequence

ATTENTION = kv_groups(4)
MAMBA = kv_groups(4, full=0, mamba=2)
HYBRID = kv_groups(4, mamba=2)
LOCAL_GLOBAL = kv_groups(4, windows=(6,))  # a full-attention group, a 6-token window's


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return make_sequence(request_id, tokens)


def table(seq: Sequence, group: int = 0) -> list[int]:
    """`seq`'s block table in `group`; empty while it holds no block."""
    return seq.block_tables[group] if seq.block_tables else []


def computed(manager: BlockManager, tokens: list[int], request_id: str = "r") -> Sequence:
    """A sequence holding blocks for `tokens`, all computed and remembered (as after its
    prefill step)."""
    seq = make_seq(tokens, request_id)
    manager.allocate(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    manager.remember_computed(seq)
    return seq


# ---------------------------------------------------------------- allocation


def test_attention_blocks_follow_the_length() -> None:
    manager = BlockManager(6, ATTENTION)
    a, b = make_seq([1] * 5, "a"), make_seq([2] * 3, "b")
    assert manager.blocks_missing(a, 5) == 2
    manager.allocate(a, 5)
    manager.allocate(b, 3)
    assert (len(table(a)), len(table(b)), len(a.block_tables)) == (2, 1, 1)
    assert not set(table(a)) & set(table(b))
    assert manager.num_used_blocks == 3
    assert manager.blocks_missing(a, 8) == 0 and manager.blocks_missing(a, 9) == 1
    assert manager.holds(a, 8) and not manager.holds(a, 9)
    first = list(table(a))
    manager.allocate(a, 9)  # grows, keeping the blocks it had
    assert table(a)[:2] == first and len(table(a)) == 3
    assert manager.can_hold(b, 12) and not manager.can_hold(b, 13)  # 2 free, b holds 1
    with pytest.raises(RuntimeError, match="3 blocks needed, 2 free"):
        manager.allocate(b, 13)
    assert len(table(b)) == 1  # a refused allocation takes nothing
    manager.free(a)
    assert (a.block_tables, manager.num_used_blocks) == ([], 1)
    manager.free(b)
    assert manager.num_used_blocks == 0


def test_state_groups_take_one_block_each_whatever_the_length() -> None:
    manager = BlockManager(4, MAMBA)
    seq = make_seq([1] * 3)
    assert manager.blocks_missing(seq, 3) == 2 and not manager.holds(seq, 3)
    manager.allocate(seq, 3)
    states = [list(t) for t in seq.block_tables]
    assert [len(t) for t in states] == [1, 1] and len({*states[0], *states[1]}) == 2
    assert manager.blocks_missing(seq, 10_000) == 0 and manager.holds(seq, 10_000)
    manager.allocate(seq, 10_000)  # longer: still the same two blocks
    assert seq.block_tables == states and manager.num_used_blocks_by_group == [1, 1]
    manager.free(seq)
    assert (seq.block_tables, manager.num_used_blocks) == ([], 0)


def test_hybrid_draws_both_kinds_from_one_pool() -> None:
    manager = BlockManager(4, HYBRID)
    a = make_seq([1] * 3, "a")
    assert manager.blocks_missing(a, 3) == 3  # two states + one attention block
    manager.allocate(a, 3)
    assert [len(t) for t in a.block_tables] == [1, 1, 1]
    states = [*table(a, 1), *table(a, 2)]
    manager.allocate(a, 5)
    assert [*table(a, 1), *table(a, 2)] == states and len(table(a)) == 2
    assert manager.num_used_blocks_by_group == [2, 1, 1]
    assert manager.num_used_blocks == 4 and not manager.can_hold(a, 9)
    attention = table(a)
    manager.free(a)
    assert manager.num_used_blocks_by_group == [0, 0, 0]
    b = make_seq([2] * 3, "b")
    manager.allocate(b, 3)
    # A block is one group's at a time: one of a's attention blocks holds a state of b's.
    assert set(attention) & {*table(b, 1), *table(b, 2)}


def test_a_window_group_releases_what_the_full_group_keeps() -> None:
    """Groups of one pool, each its own table and count: as the sequence computes, the
    window group's leading blocks out of the 6-token window are freed (NO_BLOCK, positions
    kept), the full-attention group's all stay."""
    manager = BlockManager(12, LOCAL_GLOBAL)
    seq = make_seq(list(range(17)))
    assert manager.blocks_missing(seq, 17) == 2 * 5
    manager.allocate(seq, 17)
    assert manager.num_used_blocks_by_group == [5, 5]
    seq.num_computed_tokens = 17  # the prompt's step: the next query, at 17, sees 12-17
    manager.release_out_of_window(seq)
    assert table(seq, 1)[:3] == [NO_BLOCK] * 3 and NO_BLOCK not in table(seq, 1)[3:]
    assert NO_BLOCK not in table(seq) and len(table(seq)) == len(table(seq, 1)) == 5
    assert manager.num_used_blocks_by_group == [5, 2] and manager.num_used_blocks == 7
    # Growing appends to both tables in lockstep; the released entries stay released.
    manager.allocate(seq, 21)
    assert (len(table(seq)), len(table(seq, 1))) == (6, 6)
    assert manager.num_used_blocks_by_group == [6, 3]
    manager.release_out_of_window(seq)  # nothing new out of the window yet
    assert manager.num_used_blocks_by_group == [6, 3]
    seq.num_computed_tokens = 21
    manager.release_out_of_window(seq)  # 16-21 seen: block 3 goes
    assert table(seq, 1)[:4] == [NO_BLOCK] * 4 and manager.num_used_blocks_by_group == [6, 2]
    # Released blocks went back to the one pool: 4 of 12 free, 2 for each group's table.
    other = make_seq([5] * 8, "other")
    assert manager.can_hold(other, 8) and not manager.can_hold(other, 9)
    manager.free(seq)
    assert manager.num_used_blocks == 0 and manager.num_used_blocks_by_group == [0, 0]


def test_groups_must_share_a_block_size() -> None:
    with pytest.raises(ValueError, match=r"one block_size, got \[4, 8\]"):
        BlockManager(8, [*kv_groups(4), *kv_groups(8, full=0, mamba=1)])
    with pytest.raises(ValueError, match="at least one KV cache group"):
        BlockManager(8, [])


# ---------------------------------------------------------------- prefix caching


def test_full_computed_blocks_are_found_by_content() -> None:
    manager = BlockManager(16, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(10)), "a")  # blocks of 0-3 and 4-7 are full
    assert len(a.block_hashes) == 2
    full = table(a)[:2]
    assert manager.cached_prefix(make_seq([*range(8), 50])) == (full,)
    assert manager.cached_prefix(make_seq([*range(10), 60, 61])) == (full,)  # 3rd block partial
    # Its last token is always computed (its logits are needed): 8 tokens take 1 block.
    assert manager.cached_prefix(make_seq(list(range(8)))) == (full[:1],)
    assert manager.cached_prefix(make_seq([0, 1, 2, 3, 9, 9, 9, 9, 9])) == (full[:1],)
    # A block is known by everything before it too, not by its own tokens alone.
    assert manager.cached_prefix(make_seq([9, 9, 9, 9, 4, 5, 6, 7, 8])) == ()


def test_only_computed_tokens_are_remembered() -> None:
    manager = BlockManager(8, ATTENTION, prefix_caching=True)
    seq = make_seq(list(range(12)))
    manager.allocate(seq, 12)
    seq.num_computed_tokens = 5  # a first prefill chunk
    manager.remember_computed(seq)
    assert manager.cached_prefix(make_seq(list(range(13)))) == (table(seq)[:1],)
    seq.num_computed_tokens = 12
    manager.remember_computed(seq)
    assert manager.cached_prefix(make_seq(list(range(13)))) == (table(seq)[:3],)


def test_without_prefix_caching_nothing_is_shared() -> None:
    manager = BlockManager(8, ATTENTION)
    computed(manager, list(range(9)))
    assert manager.cached_prefix(make_seq(list(range(9)))) == ()


def test_reuse_shares_blocks_until_the_last_holder_frees_them() -> None:
    manager = BlockManager(8, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(9)), "a")  # 3 blocks, 2 full
    b = make_seq([*range(8), 70, 71], "b")
    cached = manager.cached_prefix(b)
    assert cached == (table(a)[:2],)
    manager.reuse(b, cached)
    assert (table(b), b.num_computed_tokens) == (cached[0], 8)
    assert manager.num_cached_tokens == 8
    manager.allocate(b, len(b))
    assert len(table(b)) == 3 and table(b)[2] != table(a)[2]
    assert manager.num_used_blocks == 4  # 3 of a's, 1 of b's own
    manager.free(a)
    assert manager.num_used_blocks == 3  # the shared two still held by b
    manager.free(b)
    assert manager.num_used_blocks == 0
    # Freed blocks keep their content: a third prompt still finds them.
    assert manager.cached_prefix(make_seq([*range(8), 1])) == cached


def test_room_counts_reused_blocks_that_are_free() -> None:
    manager = BlockManager(3, ATTENTION, prefix_caching=True)
    manager.free(computed(manager, list(range(9))))  # 3 blocks, 2 cached, all free
    seq = make_seq([*range(8), 1, 2, 3, 4])  # 12 tokens: 3 blocks, 2 of them cached
    cached = manager.cached_prefix(seq)
    assert len(cached[0]) == 2
    assert manager.can_hold(seq, 12, reusing=cached)
    # 13 tokens need 2 blocks beyond the reused ones: of the 3 free, 2 are those.
    assert not manager.can_hold(seq, 13, reusing=cached)


def test_least_recently_freed_goes_first_and_forgets_its_content() -> None:
    manager = BlockManager(4, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(9)))  # blocks 0 and 1 cached, 2 partial; 3 free
    first, second = table(a)[:2]
    manager.free(a)  # free order now: 3, then a's blocks in table order
    prompt = make_seq([*range(8), 99])
    fresh = make_seq([5, 5, 5], "fresh")
    manager.allocate(fresh, 3)
    assert table(fresh) == [3]  # the never-used block: the cache is untouched
    assert manager.cached_prefix(prompt) == ([first, second],)
    other = make_seq([6, 6, 6], "other")
    manager.allocate(other, 3)
    assert table(other) == [first]  # handed out again: its content is gone
    assert manager.cached_prefix(prompt) == ()


def test_a_twin_block_never_unregisters_the_cached_one() -> None:
    """Two prompts computed side by side hold the same content in different blocks: only
    the first is remembered, and recycling the twin leaves it remembered."""
    manager = BlockManager(6, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(5)), "a")
    twin = computed(manager, list(range(5)), "twin")
    assert manager.cached_prefix(make_seq(list(range(6)))) == (table(a)[:1],)
    twin_blocks = set(table(twin))
    manager.free(twin)
    filler = make_seq([7] * 16, "filler")  # takes every free block, twin's among them
    manager.allocate(filler, 16)
    assert twin_blocks <= set(table(filler))
    assert manager.cached_prefix(make_seq(list(range(6)))) == (table(a)[:1],)


def test_prefix_caching_is_refused_with_mamba_state() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching needs a model without Mamba"):
        BlockManager(8, HYBRID, prefix_caching=True)
    with pytest.raises(ValueError, match="cannot be shared block by block"):
        BlockManager(8, MAMBA, prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching needs a model without Mamba"):
        BlockManager(8, kv_groups(4, full=0, windows=(6,), mamba=1), prefix_caching=True)


def test_each_group_caches_its_own_blocks_a_window_only_what_it_still_sees() -> None:
    """Local and global groups (window 6, blocks of 4): both remember a's full blocks under
    the same keys; a's window group releases its first three, which stay cached while
    free. A prompt sharing 16 tokens takes the global group's four blocks and, of the
    window group's, the two that the query at 16 sees (12-16: blocks 2 and 3)."""
    manager = BlockManager(12, LOCAL_GLOBAL, prefix_caching=True)
    a = computed(manager, list(range(17)), "a")
    local = list(table(a, 1))
    manager.release_out_of_window(a)
    assert table(a, 1)[:3] == [NO_BLOCK] * 3 and manager.num_used_blocks_by_group == [5, 2]
    b = make_seq([*range(16), 99], "b")
    cached = manager.cached_prefix(b)
    assert cached == (table(a)[:4], [NO_BLOCK, NO_BLOCK, *local[2:4]])
    assert manager.blocks_missing(b, 17) == 10
    manager.reuse(b, cached)
    assert b.num_computed_tokens == 16 and b.num_released_blocks == [0, 2]
    # One released block taken back from the free ones, the rest shared with a.
    assert manager.num_used_blocks_by_group == [5, 3] and manager.num_cached_tokens == 16
    assert manager.blocks_missing(b, 17) == 2
    manager.allocate(b, 17)
    manager.free(a)
    manager.free(b)
    assert manager.num_used_blocks == 0 and manager.num_used_blocks_by_group == [0, 0]


def test_a_window_block_gone_from_the_pool_shortens_the_hit() -> None:
    """The global group still caches all of a's 16 tokens, but the window group lost its
    block 3 (dropped by a shrink): 16 tokens cannot be served, 12 can (the query at 12
    sees blocks 1 and 2); with block 1 gone too, nothing can."""
    manager = BlockManager(12, LOCAL_GLOBAL, prefix_caching=True)
    a = computed(manager, list(range(17)), "a")
    local = list(table(a, 1))
    manager.release_out_of_window(a)
    manager.free(a)  # free, oldest first: 10 11, then local 5 6 7, global 0-4, local 8 9
    assert local[2:] == [7, 8, 9]  # global 0-4, local 5-9: shrinking to 8 drops 8 and 9
    assert manager.resize(8) == {}
    prompt = make_seq([*range(16), 99])
    assert manager.cached_prefix(prompt) == ([0, 1, 2], [NO_BLOCK, 6, 7])
    # A block in each group, the least recently freed ones: local 5 and 6 (its blocks 0
    # and 1) go, the global group's 0-3 stay cached, yet no prefix is served whole.
    filler = make_seq([5] * 4, "filler")
    manager.allocate(filler, 4)
    assert (table(filler), table(filler, 1)) == ([5], [6])
    assert manager.cached_prefix(prompt) == ()


# ---------------------------------------------------------------- resizing


def test_resize_grows_and_shrinks_moving_held_blocks_and_their_cache() -> None:
    manager = BlockManager(4, ATTENTION, prefix_caching=True)
    assert manager.resize(8) == {} and manager.num_blocks == 8
    x = computed(manager, list(range(16)), "x")  # blocks 0-3
    y = computed(manager, list(range(100, 108)), "y")  # 4-5
    manager.free(x)
    manager.free(y)  # free, oldest first: 6 7 0 1 2 3 4 5; all cached
    z = computed(manager, list(range(200, 212)), "z")
    assert table(z) == [6, 7, 0]
    moves = manager.resize(4)
    assert moves == {6: 1, 7: 2}  # to the oldest free blocks below the new end
    assert manager.num_blocks == 4 and manager.num_used_blocks == 3
    assert table(z) == [1, 2, 0]
    # z's blocks are known by content under their new ids; y's (past the end) are gone.
    assert manager.cached_prefix(make_seq([*range(200, 212), 1])) == ([1, 2, 0],)
    assert manager.cached_prefix(make_seq([*range(100, 108), 1])) == ()
    manager.free(z)
    assert manager.num_used_blocks == 0
    assert manager.resize(0) == {} and manager.cached_prefix(make_seq([*range(200, 212), 1])) == ()


def test_a_grown_pool_hands_out_its_new_blocks_before_the_cached_ones() -> None:
    """New blocks (a wake, the elastic policy's grow) hold nothing: they go before freed
    blocks that still cache a prefix, as a fresh pool's blocks do."""
    manager = BlockManager(2, ATTENTION, prefix_caching=True)
    manager.free(computed(manager, list(range(8)), "a"))  # blocks 0 and 1, both cached
    assert manager.resize(4) == {} and manager.num_free_blocks == 4
    other = make_seq([9] * 8, "other")
    manager.allocate(other, 8)
    assert table(other) == [2, 3]
    assert manager.cached_prefix(make_seq([*range(8), 1])) == ([0, 1],)
    manager.allocate(other, 9)  # then the least recently freed: its prefix is gone
    assert table(other) == [2, 3, 0] and manager.cached_prefix(make_seq([*range(8), 1])) == ()


def test_shrinking_past_held_blocks_without_room_is_refused() -> None:
    manager = BlockManager(4, ATTENTION)
    a = computed(manager, list(range(12)))  # blocks 0-2
    assert (manager.num_held_from(2), manager.num_free_below(2)) == (1, 0)
    with pytest.raises(RuntimeError, match="cannot shrink to 2 blocks: 1 held past it, 0 free"):
        manager.resize(2)
    assert manager.num_blocks == 4 and table(a) == [0, 1, 2]
    assert manager.resize(3) == {} and manager.num_used_blocks == 3


# ---------------------------------------------------------------- host tables


def test_host_tables_grow_in_rows_and_columns_keeping_what_they_hold() -> None:
    """More holders than rows and tables longer than the columns: the array doubles and
    every row still mirrors its lists; a freed row is zero and taken again."""
    manager = BlockManager(400, HYBRID)  # an attention group and a state group
    start_rows, start_columns = manager.tables.ids.shape[1:]
    seqs = [make_seq([i] * 4, str(i)) for i in range(start_rows + 3)]
    for seq in seqs:
        manager.allocate(seq, 4)
    long = seqs[0]
    manager.allocate(long, 4 * (start_columns + 5))  # block size 4: 21 entries
    ids, lengths = manager.tables.ids, manager.tables.lengths
    assert ids.shape[1] > start_rows and ids.shape[2] > start_columns
    for seq in seqs:
        for group, entries in enumerate(seq.block_tables):
            assert lengths[group, seq.table_row] == len(entries)
            assert ids[group, seq.table_row, : len(entries)].tolist() == entries
    row = long.table_row
    manager.free(long)
    assert not ids[:, row].any() and not lengths[:, row].any()
    again = make_seq([7] * 4, "again")
    manager.allocate(again, 4)
    assert again.table_row == row


# ---------------------------------------------------------------- random runs


GROUPS = {
    "attention": lambda size: kv_groups(size),
    "mamba": lambda size: kv_groups(size, full=0, mamba=2),
    "hybrid": lambda size: kv_groups(size, mamba=2),
    # Gemma-like local and global layers, and a sliding window beside Mamba state.
    "local_global": lambda size: kv_groups(size, windows=(3,)),
    "windows": lambda size: kv_groups(size, full=0, windows=(2, 5)),
    "window_mamba": lambda size: kv_groups(size, full=0, windows=(2, 5), mamba=1),
}


def held_blocks(seq: Sequence) -> list[list[int]]:
    """The blocks `seq` holds in each group (released entries left out)."""
    return [[b for b in t if b != NO_BLOCK] for t in seq.block_tables]


class BlockMachine(RuleBasedStateMachine):
    """Random add / grow / compute / free runs, prompts from a two-token alphabet so that
    prefixes repeat. A model tracks which prefix each block's KV holds: the cache must
    only hand out blocks whose content equals the prefix asked for. Each group's count
    is what its tables hold, a window group holds no block out of its window."""

    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.sampled_from([1, 2, 4]),
        # Mostly with prefix caching: it is where blocks are shared.
        kind=st.sampled_from(
            ["attention+cache"] * 2 + ["local_global+cache"] * 2 + ["windows+cache", *GROUPS]
        ),
    )
    def setup(self, num_blocks: int, block_size: int, kind: str) -> None:
        groups = GROUPS[kind.removesuffix("+cache")](block_size)
        self.manager = BlockManager(num_blocks, groups, prefix_caching=kind.endswith("cache"))
        self.holders: list[Sequence] = []
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the prefix its KV holds
        self.ids = 0

    def _allocate(self, seq: Sequence, num_tokens: int) -> None:
        before = {b for t in held_blocks(seq) for b in t}
        self.manager.allocate(seq, num_tokens)
        for block in {b for t in held_blocks(seq) for b in t} - before:
            self.content.pop(block, None)  # handed out: whatever it held is overwritten

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def add(self, tokens: list[int]) -> None:
        self.ids += 1
        seq = make_seq(tokens, str(self.ids))
        manager = self.manager
        cached = manager.cached_prefix(seq)
        size = manager.block_size
        for cached_table in cached:
            for i, block in enumerate(cached_table):
                if block != NO_BLOCK:
                    assert self.content.get(block) == tuple(tokens[: (i + 1) * size])
        if not manager.can_hold(seq, len(seq), reusing=cached):
            return
        if cached:
            manager.reuse(seq, cached)
        self._allocate(seq, len(seq))
        self.holders.append(seq)

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 99), extra=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def grow(self, index: int, extra: list[int]) -> None:
        seq = self.holders[index % len(self.holders)]
        num_tokens = len(seq) + len(extra)
        if not self.manager.can_hold(seq, num_tokens):
            held = [list(t) for t in seq.block_tables]
            with pytest.raises(RuntimeError, match="blocks needed"):
                self.manager.allocate(seq, num_tokens)
            assert seq.block_tables == held
            return
        self._allocate(seq, num_tokens)
        seq.token_ids += extra

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 99))
    def compute(self, index: int) -> None:
        """The sequence's step ran: all its tokens have their KV, and what its next query
        does not see is released, as the scheduler does when it launches a step."""
        seq = self.holders[index % len(self.holders)]
        seq.num_computed_tokens = len(seq)
        size = self.manager.block_size
        if self.manager.prefix_caching:
            for entries in seq.block_tables:
                for i, block in enumerate(entries[: len(seq) // size]):
                    if block != NO_BLOCK:
                        self.content[block] = tuple(seq.token_ids[: (i + 1) * size])
        self.manager.remember_computed(seq)
        self.manager.release_out_of_window(seq)

    @rule(num_blocks=st.integers(0, 16))
    def resize(self, num_blocks: int) -> None:
        """The pool resized as the scheduler does it: refused without room below the end,
        else every table rewritten with the moves and each moved block's content copied."""
        manager, target = self.manager, num_blocks
        if manager.num_held_from(target) > manager.num_free_below(target):
            with pytest.raises(RuntimeError, match="cannot shrink"):
                manager.resize(target)
            return
        used = manager.num_used_blocks_by_group
        moves = manager.resize(target)
        assert all(old >= target > new for old, new in moves.items())
        assert manager.num_used_blocks_by_group == used
        kept = {b: c for b, c in self.content.items() if b < target and b not in moves.values()}
        kept |= {new: self.content[old] for old, new in moves.items() if old in self.content}
        self.content = kept

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 99))
    def free(self, index: int) -> None:
        seq = self.holders.pop(index % len(self.holders))
        self.manager.free(seq)
        assert seq.block_tables == []

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        manager = self.manager
        holders = Counter(
            block for seq in self.holders for block in {b for t in held_blocks(seq) for b in t}
        )
        assert manager.num_used_blocks == len(holders)  # free + held == num_blocks
        assert manager._refs == [holders[b] for b in range(manager.num_blocks)]
        by_group: list[set[int]] = [set() for _ in manager.groups]
        for seq in self.holders:
            held = held_blocks(seq)
            every = [b for t in held for b in t]
            assert len(every) == len(set(every))
            tables = zip(manager.groups, seq.block_tables, strict=True)
            for index, (group, entries) in enumerate(tables):
                by_group[index] |= set(held[index])
                assert len(entries) == group.blocks_for(len(seq))
                released = group.num_out_of_window(seq.num_computed_tokens)
                assert entries[:released] == [NO_BLOCK] * released
                assert NO_BLOCK not in entries[released:]
        assert manager.num_used_blocks_by_group == [len(blocks) for blocks in by_group]
        assert sum(map(len, by_group)) == len(set().union(*by_group))  # one group's at a time

    @invariant()
    def host_tables_mirror_the_lists(self) -> None:
        """Every holder's row of the host tables is its lists, 0 past their ends; no two
        holders share a row."""
        host = self.manager.tables
        rows = [seq.table_row for seq in self.holders]
        assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0
        for seq in self.holders:
            for group, entries in enumerate(seq.block_tables):
                ids = host.ids[group, seq.table_row]
                assert host.lengths[group, seq.table_row] == len(entries)
                assert ids[: len(entries)].tolist() == entries
                assert not ids[len(entries) :].any()

    @invariant()
    def only_equal_prefixes_share_a_block(self) -> None:
        size = self.manager.block_size
        where: dict[int, set[tuple[int, tuple[int, ...]]]] = {}
        for seq in self.holders:
            for entries in seq.block_tables:
                for i, block in enumerate(entries):
                    prefix = tuple(seq.token_ids[: (i + 1) * size])
                    where.setdefault(block, set()).add((i, prefix))
        for block, uses in where.items():
            if block != NO_BLOCK and self.manager._refs[block] > 1:
                assert len(uses) == 1, f"block {block} shared by different prefixes: {uses}"

    def teardown(self) -> None:
        for seq in self.holders:
            self.manager.free(seq)
        assert self.manager.num_used_blocks == 0
        assert self.manager.num_used_blocks_by_group == [0] * len(self.manager.groups)


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
