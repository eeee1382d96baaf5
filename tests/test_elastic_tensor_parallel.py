"""Elastic memory under tensor parallelism on the CPU (two ranks over gloo, host backend): the
KV cache resized down and up while requests decode, sleep and wake at both levels, a grow one
rank cannot make, the elastic policy, and new weights loaded after a level-2 sleep, all leave
greedy tokens equal to one rank's and to two unresized ranks', every rank at the same block
count and memory, and no process behind."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from extkv import LLM
from extkv.demo import make_random_checkpoint
from helpers import (
    ELASTIC_OPTIONS,
    ELASTIC_PARAMS,
    ELASTIC_PROMPTS,
    MIN_BLOCKS,
    FakeClock,
    assert_nothing_leaked,
    children,
    commit_limit,
    extkv_tokens,
    resize_while_decoding,
    started_children,
)

OPTIONS = {
    **ELASTIC_OPTIONS,
    "cpu_memory_budget_bytes": 128 << 20,
    "enable_sleep_mode": True,
    "enable_prefix_caching": True,
}
# One KV head for 4 query heads (replicated on both ranks: every rank's KV cache is alike),
# and a vocabulary two ranks split unevenly (padded).
SHAPE = dict(with_tokenizer=False, vocab_size=383, num_key_value_heads=1)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("first"), "qwen3", seed=0, **SHAPE)


@pytest.fixture(scope="module")
def second(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shapes, other weights."""
    return make_random_checkpoint(tmp_path_factory.mktemp("second"), "qwen3", seed=1, **SHAPE)


def one_rank_tokens(path: Path) -> list[list[int]]:
    llm = LLM(path, **OPTIONS)
    try:
        return extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def expected(first: Path) -> list[list[int]]:
    """ELASTIC_PROMPTS' tokens on one rank, never resized."""
    return one_rank_tokens(first)


@pytest.fixture
def two_ranks(first: Path, expected: list[list[int]]) -> Iterator[LLM]:
    """A fresh two-rank engine whose unresized tokens equal one rank's; closed after the
    test, leaving no child process."""
    older = set(children())
    llm = LLM(first, tensor_parallel_size=2, **OPTIONS)
    try:
        assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
        yield llm
    finally:
        llm.close()
    assert not started_children(older)


def committed_per_rank(llm: LLM) -> list[int]:
    """Every rank's committed KV bytes, once every rank is seen to hold the pool's block
    count (the bytes may differ: each rank's granule boundaries are its own)."""
    status = llm.kv_cache_status()
    assert status["num_blocks_per_rank"] == [llm.engine.block_manager.num_blocks] * 2
    assert status["committed_bytes_per_rank"][0] == llm.engine.kv_cache.committed_bytes
    return status["committed_bytes_per_rank"]


def resident_bytes_of(pid: int) -> int:
    """The resident set of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def worker_pid() -> int:
    (pid,) = [pid for pid, cmdline in children().items() if b"spawn_main" in cmdline]
    return pid


def test_resizing_down_and_up_on_two_ranks_keeps_tokens(
    two_ranks: LLM, expected: list[list[int]]
) -> None:
    llm = two_ranks
    resize_while_decoding(llm, expected)  # the first shrink moves blocks on every rank
    committed_per_rank(llm)
    # The moved blocks' prefix-cache entries name their new places on every rank.
    cached = llm.engine.block_manager.num_cached_tokens
    assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
    assert llm.engine.block_manager.num_cached_tokens > cached


def test_sleep_and_wake_on_two_ranks_give_memory_back_and_keep_tokens(
    two_ranks: LLM, expected: list[list[int]]
) -> None:
    llm = two_ranks
    worker = worker_pid()
    kv = committed_per_rank(llm)
    assert min(kv) >= 64 << 20  # the whole budget's KV cache: plain to see in the resident set
    for level in (1, 2):
        before = resident_bytes_of(worker)
        llm.sleep(level=level)
        assert llm.is_sleeping()
        status = llm.kv_cache_status()
        assert status["num_blocks_per_rank"] == status["committed_bytes_per_rank"] == [0, 0]
        # The worker gave its KV cache back too (level 1 moves its weights to host memory:
        # no net change on the CPU; level 2 drops them, a few KiB here).
        assert before - resident_bytes_of(worker) >= 0.9 * kv[1]
        llm.wake_up(tags=["weights"])
        assert llm.kv_cache_status()["asleep"] == ["kv_cache"]
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping() and committed_per_rank(llm) == kv
        cached = llm.engine.block_manager.num_cached_tokens
        assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
        assert llm.engine.block_manager.num_cached_tokens == cached  # nothing stale was hit


def test_a_grow_one_rank_cannot_make_leaves_every_rank_at_the_smallest_count(
    two_ranks: LLM, expected: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    llm = two_ranks
    cache = llm.engine.kv_cache
    within = cache.whole_granules(MIN_BLOCKS)  # the blocks rank 0's granules for 8 hold
    target = 4096  # megabytes more on every rank
    llm.resize_kv_cache(num_blocks=MIN_BLOCKS)
    llm.resize_kv_cache(num_blocks=within)
    at_within = committed_per_rank(llm)
    # Rank 0 (this process) may commit nothing more; rank 1 reaches the target, then gives
    # back what rank 0 could not match (its memory at the target, seen below, is more).
    with commit_limit(0), caplog.at_level(logging.INFO, logger="extkv"):
        report = llm.resize_kv_cache(num_blocks=target)
    assert (report["num_blocks"], report["requested_blocks"]) == (within, target)
    assert committed_per_rank(llm) == at_within
    messages = [r.getMessage() for r in caplog.records]
    assert f"the ranks reached [{within}, {target}]; every rank keeps {within}." in messages[-1]
    assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
    assert llm.resize_kv_cache(num_blocks=target)["num_blocks"] == target  # room again
    assert all(t > w for t, w in zip(committed_per_rank(llm), at_within, strict=True))
    assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
    assert_nothing_leaked(llm)


def test_load_weights_after_a_level_2_sleep_on_two_ranks(
    first: Path, second: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    """Every rank takes its shard of the second checkpoint's weights, given once to the
    driver, and reads no checkpoint (there is none left to read); then the first's back."""
    expected_second = one_rank_tokens(second)
    assert expected_second != expected
    served = Path(shutil.copytree(first, tmp_path / "served"))
    older = set(children())
    llm = LLM(served, tensor_parallel_size=2, **OPTIONS)
    try:
        assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
        for file in served.glob("*.safetensors"):
            file.unlink()
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping() and not llm.kv_cache_status()["weights_loaded"]
        llm.load_weights(load_file(second / "model.safetensors").items())
        llm.wake_up(tags=["kv_cache"])
        assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected_second
        llm.load_weights(load_file(first / "model.safetensors").items())  # awake
        assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
    finally:
        llm.close()
    assert not started_children(older)


# Wide blocks (16 tokens x K and V x 4 heads a rank x 128 x fp32 = 64 KiB a layer on each
# rank), one segment a layer: 32 blocks to a 2 MiB granule, so the floor (8 blocks' granules)
# is 32 blocks and a burst of 8 sequences of 6 blocks needs more.
WIDE = dict(with_tokenizer=False, num_attention_heads=8, num_key_value_heads=8, head_dim=128)
BURST = [list(range(3 * i, 3 * i + 60)) for i in range(8)]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("wide"), "qwen3", **WIDE)


def test_the_elastic_policy_grows_and_gives_back_on_every_rank(
    wide: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ranks start at the floor; while rank 0 can commit nothing more the policy
    serves at that size and says so once; then a shortage grows every rank, and idle
    time gives every rank's memory back, greedy tokens always one rank's."""
    idle_s = 30.0
    options = {**OPTIONS, "kv_layout": "block_major"}
    llm = LLM(wide, **options)
    expected = extkv_tokens(llm, BURST, ELASTIC_PARAMS)
    llm.close()
    older = set(children())
    llm = LLM(
        wide,
        tensor_parallel_size=2,
        kv_cache_policy="elastic",
        kv_idle_release_s=idle_s,
        **options,
    )
    try:
        clock = FakeClock()
        llm.engine.kv_policy.clock = clock
        status = llm.kv_cache_status()
        floor = status["num_blocks_floor"]
        assert status["num_blocks"] == floor < len(BURST) * 6 < status["num_blocks_ceiling"]
        at_floor = committed_per_rank(llm)
        with commit_limit(0), caplog.at_level(logging.WARNING, logger="extkv"):
            assert extkv_tokens(llm, BURST, ELASTIC_PARAMS) == expected  # some waited
            status = llm.kv_cache_status()
            assert status["grow_held_back"] and status["num_blocks"] == floor
        assert committed_per_rank(llm) == at_floor
        refused = [r for r in caplog.records if "no memory to grow" in r.getMessage()]
        assert len(refused) == 1
        preempted = llm.engine.scheduler.num_preemptions
        assert extkv_tokens(llm, BURST, ELASTIC_PARAMS) == expected
        status = llm.kv_cache_status()
        assert status["num_blocks"] >= len(BURST) * 6 and not status["grow_held_back"]
        assert llm.engine.scheduler.num_preemptions == preempted  # grown, not preempted
        assert all(g > f for g, f in zip(committed_per_rank(llm), at_floor, strict=True))
        clock.now += idle_s
        assert llm.engine.release_idle_kv_cache() is None  # back at the floor
        assert llm.kv_cache_status()["num_blocks"] == floor
        assert committed_per_rank(llm) == at_floor
        assert_nothing_leaked(llm)
    finally:
        llm.close()
    assert not started_children(older)
