"""The Scheduler with a real BlockManager and plain sequences, no model: prompts are
computed before tokens come, long ones in chunks within the token budget; at most
max_num_seqs run; the youngest is preempted when blocks run out and recomputes from
the start; aborts and finishes (length, EOS, stop ids) give every block back. Random
add/step/abort runs on a tiny pool never leak or double-assign a block and end."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from extkv.engine.block_manager import BlockManager
from extkv.engine.sampling_params import SamplingParams
from extkv.engine.scheduler import Scheduler
from extkv.engine.sequence import Sequence, SequenceStatus
from helpers import kv_groups, make_sequence

BLOCK_SIZE = 4
EOS = 0


def next_token(seq: Sequence) -> int:
    """A token set by the length only (never EOS): a recomputed sequence gets the same."""
    return 100 + len(seq)


def launch_step(scheduler: Scheduler) -> list[Sequence] | None:
    """Plan a step and launch it as the engine does, without a model; return the
    sequences whose next token it samples (None: nothing to run). With `read_step`, the
    only code here that knows the step interface."""
    plan = scheduler.schedule()
    if plan is None:
        return None
    seqs = {seq.request_id: seq for seq in scheduler.running}  # a plan runs running ones
    scheduler.launched(plan)
    return [seqs[request.request_id] for request in plan.sampled]


def read_step(
    scheduler: Scheduler, sampled: list[Sequence], token_for: Callable[[Sequence], int]
) -> list[Sequence]:
    """The launched step's tokens reach the host: each sampled sequence gets
    `token_for(seq)`. Returns the sequences they finished."""
    tokens = [token_for(seq) for seq in sampled]
    return scheduler.update([seq.request_id for seq in sampled], tokens)


def run_step(
    scheduler: Scheduler, token_for: Callable[[Sequence], int] = next_token
) -> list[Sequence]:
    """One synchronous engine step; the sequences it finished."""
    sampled = launch_step(scheduler)
    return [] if sampled is None else read_step(scheduler, sampled, token_for)


def run_async_step(
    scheduler: Scheduler,
    in_flight: list[Sequence] | None,
    token_for: Callable[[Sequence], int] = next_token,
) -> list[Sequence] | None:
    """One engine step with asynchronous scheduling: launch the next step before reading
    the tokens of the one `in_flight`; return the step now in flight."""
    launched = launch_step(scheduler)
    if in_flight is not None:
        read_step(scheduler, in_flight, token_for)
    return launched


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    prefix_caching: bool = False,
) -> Scheduler:
    blocks = BlockManager(num_blocks, kv_groups(BLOCK_SIZE), prefix_caching)
    return Scheduler(blocks, max_num_seqs, max_num_batched_tokens, max_model_len, frozenset({EOS}))


def add(scheduler: Scheduler, request_id: str, prompt_len: int, **params: object) -> Sequence:
    seq = make_sequence(request_id, list(range(1, prompt_len + 1)), SamplingParams(**params))
    scheduler.add(seq)
    return seq


def run_to_end(scheduler: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):  # a bound, so a livelock fails instead of hanging
        if not scheduler.has_unfinished():
            return
        run_step(scheduler)
    raise AssertionError(f"requests left after {max_steps} steps")


def table(seq: Sequence) -> list[int]:
    """`seq`'s block table (one full-attention group); empty while it holds no block."""
    return seq.block_tables[0] if seq.block_tables else []


def covers(seq: Sequence) -> bool:
    """Whether `seq` holds attention blocks for every token it has computed."""
    return len(table(seq)) * BLOCK_SIZE >= seq.num_computed_tokens


# ---------------------------------------------------------------- steps


def test_prompts_are_computed_first_then_one_token_a_step() -> None:
    scheduler = make_scheduler()
    a, b = add(scheduler, "a", 5, max_tokens=10), add(scheduler, "b", 3, max_tokens=10)
    run_step(scheduler)
    assert a.status == b.status == SequenceStatus.RUNNING
    assert scheduler.running == [a, b] and not scheduler.waiting
    assert (a.num_computed_tokens, a.output_token_ids) == (5, [106])
    assert (b.num_computed_tokens, b.output_token_ids) == (3, [104])
    for step in range(2, 5):
        run_step(scheduler)
        assert len(a.output_token_ids) == len(b.output_token_ids) == step
        assert a.num_computed_tokens == 5 + step - 1 and covers(a) and covers(b)
    # A newcomer's whole prompt is computed on the next step.
    c = add(scheduler, "c", 6, max_tokens=10)
    run_step(scheduler)
    assert (c.num_computed_tokens, len(c.output_token_ids)) == (6, 1)


def test_long_prompts_are_chunked_within_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a, b = add(scheduler, "a", 20, max_tokens=4), add(scheduler, "b", 5, max_tokens=4)
    run_step(scheduler)
    assert (a.num_computed_tokens, a.output_token_ids) == (8, [])
    steps = 1
    while not (a.output_token_ids and b.output_token_ids):
        before = a.num_computed_tokens + b.num_computed_tokens
        run_step(scheduler)
        steps += 1
        assert 0 < a.num_computed_tokens + b.num_computed_tokens - before <= 8
        for seq in (a, b):  # no token before the whole prompt is computed
            assert bool(seq.output_token_ids) == (seq.num_computed_tokens >= seq.num_prompt_tokens)
            assert covers(seq)
        assert steps < 10
    assert steps >= 4  # 25 prompt tokens at most 8 a step
    run_to_end(scheduler)
    assert a.output_token_ids == [121, 122, 123, 124]  # one token per position, none lost


def test_at_most_max_num_seqs_run() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [add(scheduler, str(i), 3, max_tokens=4) for i in range(5)]
    run_step(scheduler)
    assert scheduler.running == seqs[:2] and list(scheduler.waiting) == seqs[2:]
    while scheduler.has_unfinished():
        run_step(scheduler)
        assert len(scheduler.running) <= 2
    assert all(len(seq.output_token_ids) == 4 for seq in seqs)
    assert scheduler.block_manager.num_used_blocks == 0


def test_the_youngest_is_preempted_and_recomputes_from_the_start() -> None:
    """4 blocks of 4 tokens; a and b take one each, then grow. When a needs its third
    block there is none: b, admitted after a, gives its blocks back and goes to the head
    of the queue, ahead of c (which waits for a free slot)."""
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2, max_model_len=16)
    a, b = add(scheduler, "a", 4, max_tokens=20), add(scheduler, "b", 4, max_tokens=20)
    c = add(scheduler, "c", 2, max_tokens=3)
    while scheduler.num_preemptions == 0:
        run_step(scheduler)
        assert len(a.output_token_ids) < 10, "no preemption"
    assert (b.status, b.num_computed_tokens, table(b)) == (SequenceStatus.WAITING, 0, [])
    assert list(scheduler.waiting) == [b, c] and scheduler.running == [a]
    assert len(table(a)) == 3 and covers(a)
    tokens_of_b = list(b.output_token_ids)  # kept: recomputing gives the same KV
    run_to_end(scheduler)
    assert b.output_token_ids[: len(tokens_of_b)] == tokens_of_b
    for seq in (a, b):
        assert (len(seq), seq.finish_reason) == (16, "length")  # max_model_len
    assert scheduler.block_manager.num_used_blocks == 0


def test_async_a_token_in_flight_that_ends_a_sequence_is_its_last() -> None:
    """With the next step launched before the last one's tokens are read, a sequence
    whose in-flight token reaches max_tokens is not scheduled again."""
    scheduler = make_scheduler()
    seq = add(scheduler, "a", 3, max_tokens=2)
    in_flight = run_async_step(scheduler, None)  # the prompt; token 1 in flight
    in_flight = run_async_step(scheduler, in_flight)  # token 2 in flight, token 1 read
    assert (seq.num_computed_tokens, seq.num_pending, len(seq.output_token_ids)) == (4, 1, 1)
    assert run_async_step(scheduler, in_flight) is None  # token 2 read: nothing to launch
    assert (seq.finish_reason, len(seq.output_token_ids)) == ("length", 2)
    assert seq.num_computed_tokens == 4  # its last token never computed
    assert scheduler.block_manager.num_used_blocks == 0


def test_async_preempted_with_its_last_token_in_flight_finishes_from_the_queue() -> None:
    """4 blocks of 4: a (prompt 4) waits a step for its third block, b (prompt 2) runs on;
    then a, with nothing in flight, preempts b while b's last token is in flight. That
    token finishes b in the waiting queue, which lets go of it."""
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2, max_model_len=16)
    a, b = add(scheduler, "a", 4, max_tokens=20), add(scheduler, "b", 2, max_tokens=6)
    in_flight = None
    while scheduler.num_preemptions == 0:
        in_flight = run_async_step(scheduler, in_flight)
        assert len(a.output_token_ids) < 10, "no preemption"
    assert b.finish_reason == "length" and len(b.output_token_ids) == 6
    assert b not in scheduler.waiting and table(b) == [] and b.num_pending == 0
    assert scheduler.running == [a] and not scheduler.waiting
    while in_flight is not None or scheduler.has_unfinished():
        in_flight = run_async_step(scheduler, in_flight)
    assert a.finish_reason == "length" and scheduler.block_manager.num_used_blocks == 0


# ---------------------------------------------------------------- endings


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = add(scheduler, "a", 6), add(scheduler, "b", 3)
    run_step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 2  # a's, b waits
    assert scheduler.abort("a") is a
    assert (a.status, a.finish_reason, table(a)) == (SequenceStatus.FINISHED, "abort", [])
    assert scheduler.block_manager.num_used_blocks == 0 and a not in scheduler.running
    assert scheduler.abort("b", reason="error") is b
    assert b.finish_reason == "error" and not scheduler.waiting
    assert scheduler.abort("nobody") is None
    assert not scheduler.has_unfinished() and run_step(scheduler) == []


def test_max_tokens_and_max_model_len_finish_by_length() -> None:
    scheduler = make_scheduler(max_model_len=8)
    short, long = add(scheduler, "short", 3, max_tokens=3), add(scheduler, "long", 6)
    finished = [run_step(scheduler) for _ in range(3)]
    assert finished == [[], [long], [short]]  # long: 2 tokens reach max_model_len
    assert (len(long.output_token_ids), long.finish_reason) == (2, "length")
    assert (len(short.output_token_ids), short.finish_reason) == (3, "length")
    assert short.status == SequenceStatus.FINISHED and not scheduler.has_unfinished()
    assert scheduler.block_manager.num_used_blocks == 0


def test_eos_and_stop_token_ids_finish_by_stop() -> None:
    scheduler = make_scheduler()
    eos = add(scheduler, "eos", 3, max_tokens=10)
    ignored = add(scheduler, "ignored", 3, max_tokens=5, ignore_eos=True)
    stop = add(scheduler, "stop", 3, max_tokens=10, stop_token_ids=[7])
    script = {("eos", 1): EOS, ("ignored", 1): EOS, ("stop", 1): 7}  # their 2nd tokens

    def token_for(seq: Sequence) -> int:
        return script.get((seq.request_id, len(seq.output_token_ids)), 1)

    run_step(scheduler, token_for)
    assert run_step(scheduler, token_for) == [eos, stop]
    assert (eos.output_token_ids, eos.finish_reason) == ([1, EOS], "stop")
    assert (stop.output_token_ids, stop.finish_reason) == ([1, 7], "stop")
    run_to_end(scheduler)
    assert (len(ignored.output_token_ids), ignored.finish_reason) == (5, "length")
    assert ignored.output_token_ids[1] == EOS
    assert scheduler.block_manager.num_used_blocks == 0


# ---------------------------------------------------------------- random runs


def check_blocks(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """Every block in use is held by running sequences only; one held twice is a shared
    cached block of one prefix; nothing is lost."""
    running = scheduler.running
    assert len(running) <= scheduler.max_num_seqs
    holders = Counter(block for seq in running for block in table(seq))
    assert scheduler.block_manager.num_used_blocks == len(holders)
    prefixes: dict[int, set[tuple[int, ...]]] = {}
    for seq in running:
        assert seq.status == SequenceStatus.RUNNING and covers(seq)
        assert len(set(table(seq))) == len(table(seq))
        for i, block in enumerate(table(seq)):
            prefixes.setdefault(block, set()).add(tuple(seq.token_ids[: (i + 1) * BLOCK_SIZE]))
    for block, count in holders.items():
        assert count == 1 or len(prefixes[block]) == 1, f"block {block}: {prefixes[block]}"
    for seq in seqs:
        if seq not in running:
            assert table(seq) == [] and seq.status != SequenceStatus.RUNNING


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.lists(st.integers(1, 2), min_size=1, max_size=15), st.integers(1, 12)
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 99)),
    ),
    max_size=40,
)


def run_ops(
    scheduler: Scheduler,
    ops: list,
    async_scheduling: bool,
    check: Callable[[Scheduler, list[Sequence]], None],
) -> None:
    """Add, step and abort as `ops` say, then step until every request has ended; `check`
    after each op and step. With asynchronous scheduling each step is launched before
    the tokens of the one in flight are read, as the engine does by default."""
    seqs: list[Sequence] = []
    aborted: set[str] = set()
    in_flight: list[Sequence] | None = None

    def step() -> None:
        nonlocal in_flight
        token_for = lambda seq: (len(seq) + int(seq.request_id)) % 7  # noqa: E731
        if async_scheduling:
            in_flight = run_async_step(scheduler, in_flight, token_for)
        else:
            run_step(scheduler, token_for)

    for op in ops:
        if op[0] == "add":
            seq = make_sequence(str(len(seqs)), op[1], SamplingParams(max_tokens=op[2]))
            seqs.append(seq)
            scheduler.add(seq)
        elif op[0] == "step":
            step()
        elif seqs:
            seq = seqs[op[1] % len(seqs)]
            done = seq.status == SequenceStatus.FINISHED
            assert (scheduler.abort(seq.request_id) is None) == done
            if not done:
                aborted.add(seq.request_id)
        check(scheduler, seqs)
    for _ in range(1000):  # a bound, so a livelock fails instead of hanging
        if not (scheduler.has_unfinished() or in_flight):
            break
        step()
        check(scheduler, seqs)
    assert not scheduler.has_unfinished(), "requests left after 1000 steps"
    assert scheduler.block_manager.num_used_blocks == 0
    for seq in seqs:
        assert seq.status == SequenceStatus.FINISHED and seq.num_pending == 0
        if seq.request_id in aborted:
            assert seq.finish_reason == "abort"
        elif seq.finish_reason == "stop":
            assert seq.token_ids[-1] == EOS
        else:
            assert seq.finish_reason == "length"
            assert len(seq.output_token_ids) == seq.params.max_tokens or len(seq) == 16


@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(4, 8),  # 4 hold one sequence of max_model_len 16
    max_num_seqs=st.integers(1, 4),
    extra_budget=st.integers(0, 20),
    prefix_caching=st.booleans(),
    async_scheduling=st.booleans(),
    ops=OPS,
)
def test_random_runs_never_leak_and_always_end(
    num_blocks: int,
    max_num_seqs: int,
    extra_budget: int,
    prefix_caching: bool,
    async_scheduling: bool,
    ops: list,
) -> None:
    scheduler = make_scheduler(
        num_blocks, max_num_seqs, max_num_seqs + extra_budget, 16, prefix_caching
    )
    run_ops(scheduler, ops, async_scheduling, check_blocks)


GROUPS = {  # a full-attention group beside windows of 3 and 6 tokens, or Mamba state
    "local_global": dict(windows=(3, 6)),
    "hybrid": dict(mamba=2),
    "window_mamba": dict(full=0, windows=(5,), mamba=1),
}


def check_groups(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """Each group's count is what the running sequences' tables hold in it; no block is in
    two tables; a sequence holds no more in a group than the plan's bound for it."""
    manager = scheduler.block_manager
    held: list[list[int]] = [[] for _ in manager.groups]
    for seq in scheduler.running:
        for index, (group, table) in enumerate(zip(manager.groups, seq.block_tables, strict=True)):
            blocks = [b for b in table if b >= 0]
            held[index] += blocks
            assert len(blocks) <= group.max_blocks_per_seq(16, scheduler.max_num_batched_tokens)
        lengths = [len(t) for g, t in zip(manager.groups, seq.block_tables, strict=True)]
        per_token = {n for g, n in zip(manager.groups, lengths, strict=True) if g.per_token}
        assert len(per_token) == 1  # the attention groups grow in lockstep
        assert all(n == 1 for g, n in zip(manager.groups, lengths, strict=True) if not g.per_token)
    every = [b for blocks in held for b in blocks]
    assert len(every) == len(set(every))
    assert manager.num_used_blocks_by_group == [len(blocks) for blocks in held]
    for seq in seqs:
        if seq not in scheduler.running:
            assert seq.block_tables == []


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(list(GROUPS)),
    extra_blocks=st.integers(0, 4),
    max_num_seqs=st.integers(1, 4),
    extra_budget=st.integers(0, 4),  # small steps: a window bounds what a sequence holds
    async_scheduling=st.booleans(),
    ops=OPS,
)
def test_random_runs_with_kv_cache_groups_never_leak_and_always_end(
    kind: str,
    extra_blocks: int,
    max_num_seqs: int,
    extra_budget: int,
    async_scheduling: bool,
    ops: list,
) -> None:
    """Groups that keep blocks differently, one pool as small as one sequence of
    max_model_len needs (`KVCachePlan.blocks_per_seq`, a window group counting its window
    and one step only): preemption frees every group's blocks, nothing livelocks."""
    groups = kv_groups(BLOCK_SIZE, **GROUPS[kind])
    budget = max_num_seqs + extra_budget
    least = sum(group.max_blocks_per_seq(16, budget) for group in groups)
    blocks = BlockManager(least + extra_blocks, groups)
    scheduler = Scheduler(blocks, max_num_seqs, budget, 16, frozenset({EOS}))
    run_ops(scheduler, ops, async_scheduling, check_groups)
    assert blocks.num_used_blocks_by_group == [0] * len(groups)
