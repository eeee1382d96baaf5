"""BlockManager alone, no model: blocks for attention, for recurrent state and for both
from one pool; prefix caching by content, shared by reference count, forgotten when the
pool hands a block out again; the pool resized (held blocks moved below a new end, their
cached content with them); and random add/grow/compute/free/resize runs that never leak
or share a block they should not."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extkv.engine.block_manager import BlockManager
from extkv.engine.sequence import Sequence
from extkv.kv_cache.plan import BlockNeeds
from helpers import make_sequence

ATTENTION = BlockNeeds(block_size=4)
MAMBA = BlockNeeds(block_size=4, has_attention=False, num_state_groups=2)
HYBRID = BlockNeeds(block_size=4, has_attention=True, num_state_groups=2)


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return make_sequence(request_id, tokens)


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
    assert (len(a.block_table), len(b.block_table), a.state_blocks) == (2, 1, [])
    assert not set(a.block_table) & set(b.block_table)
    assert manager.num_used_blocks == 3
    assert manager.blocks_missing(a, 8) == 0 and manager.blocks_missing(a, 9) == 1
    first = list(a.block_table)
    manager.allocate(a, 9)  # grows, keeping the blocks it had
    assert a.block_table[:2] == first and len(a.block_table) == 3
    assert manager.can_hold(b, 12) and not manager.can_hold(b, 13)  # 2 free, b holds 1
    with pytest.raises(RuntimeError, match="3 blocks needed, 2 free"):
        manager.allocate(b, 13)
    assert len(b.block_table) == 1  # a refused allocation takes nothing
    manager.free(a)
    assert (a.block_table, manager.num_used_blocks) == ([], 1)
    manager.free(b)
    assert manager.num_used_blocks == 0


def test_state_groups_take_one_block_each_whatever_the_length() -> None:
    manager = BlockManager(4, MAMBA)
    seq = make_seq([1] * 3)
    assert manager.blocks_missing(seq, 3) == 2
    manager.allocate(seq, 3)
    states = list(seq.state_blocks)
    assert len(set(states)) == 2 and seq.block_table == []
    assert manager.blocks_missing(seq, 10_000) == 0
    manager.allocate(seq, 10_000)  # longer: still the same two blocks
    assert seq.state_blocks == states and manager.num_used_blocks == 2
    assert seq.slot(7, 4) == -1  # no per-token cache
    manager.free(seq)
    assert (seq.state_blocks, manager.num_used_blocks) == ([], 0)


def test_hybrid_draws_both_kinds_from_one_pool() -> None:
    manager = BlockManager(4, HYBRID)
    a = make_seq([1] * 3, "a")
    assert manager.blocks_missing(a, 3) == 3  # two states + one attention block
    manager.allocate(a, 3)
    assert (len(a.state_blocks), len(a.block_table)) == (2, 1)
    states = list(a.state_blocks)
    manager.allocate(a, 5)
    assert a.state_blocks == states and len(a.block_table) == 2
    assert manager.num_used_blocks == 4 and not manager.can_hold(a, 9)
    manager.free(a)
    b = make_seq([2] * 8, "b")
    manager.allocate(b, 8)
    held = [*b.block_table, *b.state_blocks]
    assert sorted(held) == [0, 1, 2, 3]
    # A block is one kind at a time: a's old states now hold some of b's attention.
    assert set(states) & set(b.block_table)


# ---------------------------------------------------------------- prefix caching


def test_full_computed_blocks_are_found_by_content() -> None:
    manager = BlockManager(16, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(10)), "a")  # blocks of 0-3 and 4-7 are full
    assert len(a.block_hashes) == 2
    full = a.block_table[:2]
    assert manager.cached_prefix(make_seq([*range(8), 50])) == full
    assert manager.cached_prefix(make_seq([*range(10), 60, 61])) == full  # 3rd block partial
    # Its last token is always computed (its logits are needed): 8 tokens take 1 block.
    assert manager.cached_prefix(make_seq(list(range(8)))) == full[:1]
    assert manager.cached_prefix(make_seq([0, 1, 2, 3, 9, 9, 9, 9, 9])) == full[:1]
    # A block is known by everything before it too, not by its own tokens alone.
    assert manager.cached_prefix(make_seq([9, 9, 9, 9, 4, 5, 6, 7, 8])) == []


def test_only_computed_tokens_are_remembered() -> None:
    manager = BlockManager(8, ATTENTION, prefix_caching=True)
    seq = make_seq(list(range(12)))
    manager.allocate(seq, 12)
    seq.num_computed_tokens = 5  # a first prefill chunk
    manager.remember_computed(seq)
    assert manager.cached_prefix(make_seq(list(range(13)))) == seq.block_table[:1]
    seq.num_computed_tokens = 12
    manager.remember_computed(seq)
    assert manager.cached_prefix(make_seq(list(range(13)))) == seq.block_table[:3]


def test_without_prefix_caching_nothing_is_shared() -> None:
    manager = BlockManager(8, ATTENTION)
    computed(manager, list(range(9)))
    assert manager.cached_prefix(make_seq(list(range(9)))) == []


def test_reuse_shares_blocks_until_the_last_holder_frees_them() -> None:
    manager = BlockManager(8, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(9)), "a")  # 3 blocks, 2 full
    b = make_seq([*range(8), 70, 71], "b")
    cached = manager.cached_prefix(b)
    assert cached == a.block_table[:2]
    manager.reuse(b, cached)
    assert (b.block_table, b.num_computed_tokens) == (cached, 8)
    assert manager.num_cached_tokens == 8
    manager.allocate(b, len(b))
    assert len(b.block_table) == 3 and b.block_table[2] != a.block_table[2]
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
    assert len(cached) == 2
    assert manager.can_hold(seq, 12, reusing=cached)
    # 13 tokens need 2 blocks beyond the reused ones: of the 3 free, 2 are those.
    assert not manager.can_hold(seq, 13, reusing=cached)


def test_least_recently_freed_goes_first_and_forgets_its_content() -> None:
    manager = BlockManager(4, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(9)))  # blocks 0 and 1 cached, 2 partial; 3 free
    first, second = a.block_table[:2]
    manager.free(a)  # free order now: 3, then a's blocks in table order
    prompt = make_seq([*range(8), 99])
    fresh = make_seq([5, 5, 5], "fresh")
    manager.allocate(fresh, 3)
    assert fresh.block_table == [3]  # the never-used block: the cache is untouched
    assert manager.cached_prefix(prompt) == [first, second]
    other = make_seq([6, 6, 6], "other")
    manager.allocate(other, 3)
    assert other.block_table == [first]  # handed out again: its content is gone
    assert manager.cached_prefix(prompt) == []


def test_a_twin_block_never_unregisters_the_cached_one() -> None:
    """Two prompts computed side by side hold the same content in different blocks: only
    the first is remembered, and recycling the twin leaves it remembered."""
    manager = BlockManager(6, ATTENTION, prefix_caching=True)
    a = computed(manager, list(range(5)), "a")
    twin = computed(manager, list(range(5)), "twin")
    assert manager.cached_prefix(make_seq(list(range(6)))) == a.block_table[:1]
    twin_blocks = set(twin.block_table)
    manager.free(twin)
    filler = make_seq([7] * 16, "filler")  # takes every free block, twin's among them
    manager.allocate(filler, 16)
    assert twin_blocks <= set(filler.block_table)
    assert manager.cached_prefix(make_seq(list(range(6)))) == a.block_table[:1]


def test_prefix_caching_is_refused_with_state_groups() -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching needs a model without Mamba"):
        BlockManager(8, HYBRID, prefix_caching=True)
    with pytest.raises(ValueError, match="cannot be shared block by block"):
        BlockManager(8, MAMBA, prefix_caching=True)


# ---------------------------------------------------------------- resizing


def test_resize_grows_and_shrinks_moving_held_blocks_and_their_cache() -> None:
    manager = BlockManager(4, ATTENTION, prefix_caching=True)
    assert manager.resize(8) == {} and manager.num_blocks == 8
    x = computed(manager, list(range(16)), "x")  # blocks 0-3
    y = computed(manager, list(range(100, 108)), "y")  # 4-5
    manager.free(x)
    manager.free(y)  # free, oldest first: 6 7 0 1 2 3 4 5; all cached
    z = computed(manager, list(range(200, 212)), "z")
    assert z.block_table == [6, 7, 0]
    moves = manager.resize(4)
    assert moves == {6: 1, 7: 2}  # to the oldest free blocks below the new end
    assert manager.num_blocks == 4 and manager.num_used_blocks == 3
    z.block_table = [moves.get(b, b) for b in z.block_table]
    # z's blocks are known by content under their new ids; y's (past the end) are gone.
    assert manager.cached_prefix(make_seq([*range(200, 212), 1])) == [1, 2, 0]
    assert manager.cached_prefix(make_seq([*range(100, 108), 1])) == []
    manager.free(z)
    assert manager.num_used_blocks == 0
    assert manager.resize(0) == {} and manager.cached_prefix(make_seq([*range(200, 212), 1])) == []


def test_shrinking_past_held_blocks_without_room_is_refused() -> None:
    manager = BlockManager(4, ATTENTION)
    a = computed(manager, list(range(12)))  # blocks 0-2
    assert (manager.num_held_from(2), manager.num_free_below(2)) == (1, 0)
    with pytest.raises(RuntimeError, match="cannot shrink to 2 blocks: 1 held past it, 0 free"):
        manager.resize(2)
    assert manager.num_blocks == 4 and a.block_table == [0, 1, 2]
    assert manager.resize(3) == {} and manager.num_used_blocks == 3


# ---------------------------------------------------------------- random runs


class BlockMachine(RuleBasedStateMachine):
    """Random add / grow / compute / free runs, prompts from a two-token alphabet so that
    prefixes repeat. A model tracks which prefix each block's KV holds: the cache must
    only hand out blocks whose content equals the prefix asked for."""

    @initialize(
        num_blocks=st.integers(4, 12),
        block_size=st.sampled_from([1, 2, 4]),
        # Mostly with prefix caching: it is where blocks are shared.
        kind=st.sampled_from(["attention+cache"] * 3 + ["attention", "mamba", "hybrid"]),
    )
    def setup(self, num_blocks: int, block_size: int, kind: str) -> None:
        groups = 0 if kind.startswith("attention") else 2
        needs = BlockNeeds(block_size, has_attention=kind != "mamba", num_state_groups=groups)
        self.manager = BlockManager(num_blocks, needs, prefix_caching=kind.endswith("cache"))
        self.holders: list[Sequence] = []
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the prefix its KV holds
        self.ids = 0

    def _allocate(self, seq: Sequence, num_tokens: int) -> None:
        before = {*seq.block_table, *seq.state_blocks}
        self.manager.allocate(seq, num_tokens)
        for block in {*seq.block_table, *seq.state_blocks} - before:
            self.content.pop(block, None)  # handed out: whatever it held is overwritten

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def add(self, tokens: list[int]) -> None:
        self.ids += 1
        seq = make_seq(tokens, str(self.ids))
        manager = self.manager
        cached = manager.cached_prefix(seq)
        size = manager.needs.block_size
        for i, block in enumerate(cached):
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
            held = (list(seq.block_table), list(seq.state_blocks))
            with pytest.raises(RuntimeError, match="blocks needed"):
                self.manager.allocate(seq, num_tokens)
            assert (seq.block_table, seq.state_blocks) == held
            return
        self._allocate(seq, num_tokens)
        seq.token_ids += extra

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 99))
    def compute(self, index: int) -> None:
        """The sequence's step ran: all its tokens have their KV."""
        seq = self.holders[index % len(self.holders)]
        seq.num_computed_tokens = len(seq)
        size = self.manager.needs.block_size
        for i, block in enumerate(seq.block_table[: len(seq) // size]):
            self.content[block] = tuple(seq.token_ids[: (i + 1) * size])
        self.manager.remember_computed(seq)

    @rule(num_blocks=st.integers(0, 16))
    def resize(self, num_blocks: int) -> None:
        """The pool resized as the scheduler does it: refused without room below the end,
        else every table rewritten with the moves and each moved block's content copied."""
        manager, target = self.manager, num_blocks
        if manager.num_held_from(target) > manager.num_free_below(target):
            with pytest.raises(RuntimeError, match="cannot shrink"):
                manager.resize(target)
            return
        moves = manager.resize(target)
        assert all(old >= target > new for old, new in moves.items())
        kept = {b: c for b, c in self.content.items() if b < target and b not in moves.values()}
        kept |= {new: self.content[old] for old, new in moves.items() if old in self.content}
        self.content = kept
        for seq in self.holders:
            seq.block_table = [moves.get(b, b) for b in seq.block_table]
            seq.state_blocks = [moves.get(b, b) for b in seq.state_blocks]

    @precondition(lambda self: self.holders)
    @rule(index=st.integers(0, 99))
    def free(self, index: int) -> None:
        seq = self.holders.pop(index % len(self.holders))
        self.manager.free(seq)
        assert (seq.block_table, seq.state_blocks) == ([], [])

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        manager = self.manager
        holders = Counter(
            block for seq in self.holders for block in {*seq.block_table, *seq.state_blocks}
        )
        assert manager.num_used_blocks == len(holders)  # free + held == num_blocks
        assert manager._refs == [holders[b] for b in range(manager.num_blocks)]
        for seq in self.holders:
            held = [*seq.block_table, *seq.state_blocks]
            assert len(held) == len(set(held))
            assert len(held) == manager.needs.blocks_for(len(seq))

    @invariant()
    def only_equal_prefixes_share_a_block(self) -> None:
        size = self.manager.needs.block_size
        where: dict[int, set[tuple[int, tuple[int, ...]]]] = {}
        for seq in self.holders:
            assert not set(seq.state_blocks) & {
                b for other in self.holders if other is not seq for b in other.state_blocks
            }
            for i, block in enumerate(seq.block_table):
                where.setdefault(block, set()).add((i, tuple(seq.token_ids[: (i + 1) * size])))
        for block, uses in where.items():
            if self.manager._refs[block] > 1:
                assert len(uses) == 1, f"block {block} shared by different prefixes: {uses}"

    def teardown(self) -> None:
        for seq in self.holders:
            self.manager.free(seq)
        assert self.manager.num_used_blocks == 0


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
