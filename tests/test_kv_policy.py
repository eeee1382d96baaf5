"""The elastic KV cache policy on the CPU (host backend, a tiny random Qwen3 whose blocks are
large enough that a granule per segment holds only 32 of them): a burst grows the cache by whole
granules, idle time (a fake clock) gives it back, greedy tokens equal the static policy's; a
grow the commit limit refuses leaves the engine serving at its size; two engines share one
commit limit; bad options are refused by name."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from helpers import FakeClock, assert_nothing_leaked, commit_limit, extkv_tokens

OPTIONS = dict(
    cpu_memory_budget_bytes=96 << 20,
    max_model_len=128,  # 8 blocks: the least the floor holds
    max_num_batched_tokens=512,
    max_num_seqs=8,
    enable_extensible_kv_cache=True,
    kv_layout="block_major",  # one segment per layer: granule-aligned, so the floor is 32
)
MIN_BLOCKS = 8
IDLE_S = 30.0
FLOOR = 32
# 8 sequences of 6 blocks (84 tokens): 48 blocks, more than the floor; 6 of them, 36.
BURST = [list(range(3 * i, 3 * i + 60)) for i in range(8)]
FEW = 6
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A block of 64 KiB per layer (16 tokens x K and V x 4 heads x 128 x fp32): 32 to a
    granule."""
    return make_random_checkpoint(
        tmp_path_factory.mktemp("wide"), head_dim=128, num_key_value_heads=4
    )


@pytest.fixture(scope="module")
def expected(wide: Path) -> list[list[int]]:
    """BURST's tokens under the static policy."""
    llm = LLM(wide, **OPTIONS)
    tokens = extkv_tokens(llm, BURST, PARAMS)
    llm.close()
    return tokens


def elastic(wide: Path) -> tuple[LLM, FakeClock]:
    llm = LLM(wide, kv_cache_policy="elastic", kv_idle_release_s=IDLE_S, **OPTIONS)
    clock = FakeClock()
    llm.engine.kv_policy.clock = clock
    return llm, clock


def assert_whole_granules(llm: LLM) -> None:
    """The committed blocks fill whole granules: one block more would take another."""
    cache = llm.engine.kv_cache
    assert cache.committed_bytes == cache.bytes_for(cache.num_blocks)
    assert cache.bytes_for(cache.num_blocks + 1) > cache.committed_bytes


def test_a_burst_grows_the_cache_and_idle_time_gives_it_back(
    wide: Path, expected: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    llm, clock = elastic(wide)
    engine, cache = llm.engine, llm.engine.kv_cache
    status = llm.kv_cache_status()
    floor = status["num_blocks_floor"]
    assert status["policy"] == "elastic" and status["num_blocks"] == floor == FLOOR
    assert cache.bytes_for(floor) == cache.bytes_for(MIN_BLOCKS)  # one sequence's granules
    assert floor < len(BURST) * 6 < status["num_blocks_ceiling"]
    assert status["idle_release_s"] == IDLE_S
    assert_whole_granules(llm)
    floor_bytes = cache.committed_bytes
    with caplog.at_level(logging.INFO, logger="extkv"):
        assert extkv_tokens(llm, BURST, PARAMS) == expected
        status = llm.kv_cache_status()
        grown = status["num_blocks"]
        assert grown >= len(BURST) * 6 and status["num_resizes"]["grow"] >= 1
        assert_whole_granules(llm)
        assert engine.scheduler.num_preemptions == 0  # grown rather than preempted
        clock.now += IDLE_S - 1
        assert 0 < llm.engine.release_idle_kv_cache() <= 1  # used within the window: kept
        assert llm.kv_cache_status()["num_blocks"] == grown
        clock.now += 1
        assert llm.engine.release_idle_kv_cache() is None  # at the floor: nothing left
    status = llm.kv_cache_status()
    assert status["num_blocks"] == floor and status["num_resizes"]["shrink"] == 1
    assert cache.committed_bytes == floor_bytes
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"Extended KV cache to {grown} blocks.") for m in logged)
    assert any(m.startswith(f"Shrank KV cache to {floor} blocks.") for m in logged)
    assert_nothing_leaked(llm)
    grows = status["num_resizes"]["grow"]
    assert extkv_tokens(llm, BURST, PARAMS) == expected  # and grows again
    assert llm.kv_cache_status()["num_resizes"]["grow"] > grows
    llm.close()


def test_releasing_while_decoding_keeps_the_blocks_in_use_and_the_tokens(
    wide: Path, expected: list[list[int]]
) -> None:
    """Half the burst stops early; the clock then jumps past the idle time, and the cache
    shrinks to the granules the rest hold (moving blocks down, preempting nothing) while
    they decode on."""
    llm, clock = elastic(wide)
    engine = llm.engine
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # 5 blocks
    ids = [engine.add_request(p, short if i % 2 else PARAMS) for i, p in enumerate(BURST)]
    tokens = {}
    shrunk = False
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step(finished_only=True)}
        if len(tokens) == len(BURST) // 2 and not shrunk:
            before = llm.kv_cache_status()["num_blocks"]
            for _ in range(2):  # the first still sees the step that finished them
                clock.now += IDLE_S
                engine.release_idle_kv_cache()
            used = engine.block_manager.num_used_blocks
            status = llm.kv_cache_status()
            assert status["num_blocks"] == engine.kv_cache.whole_granules(used) < before
            shrunk = True
    assert shrunk
    assert [tokens[i] for i in ids] == [t[:12] if i % 2 else t for i, t in enumerate(expected)]
    assert engine.scheduler.num_preemptions == 0
    assert_nothing_leaked(llm)
    llm.close()


def test_a_refused_grow_serves_at_its_size_and_says_so_once(
    wide: Path, expected: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    llm, _ = elastic(wide)
    with commit_limit(0), caplog.at_level(logging.WARNING, logger="extkv"):
        assert extkv_tokens(llm, BURST[:FEW], PARAMS) == expected[:FEW]  # some waited
        status = llm.kv_cache_status()
    assert status["num_blocks"] == status["num_blocks_floor"]
    assert status["num_resizes"]["grow"] == 0 and status["grow_held_back"]
    refused = [r for r in caplog.records if "no memory to grow" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING
    assert_nothing_leaked(llm)
    # The limit gone, the next shortage grows the cache again.
    assert extkv_tokens(llm, BURST[:FEW], PARAMS) == expected[:FEW]
    status = llm.kv_cache_status()
    assert status["num_blocks"] > status["num_blocks_floor"] and not status["grow_held_back"]
    llm.close()


def test_two_engines_share_one_commit_limit(wide: Path, expected: list[list[int]]) -> None:
    """The first engine grows; then nothing is left under the limit: the second serves at
    its floor until the first, idle, gives its memory back, and grows into it then."""
    (first, first_clock), (second, _) = elastic(wide), elastic(wide)
    assert extkv_tokens(first, BURST, PARAMS) == expected
    with commit_limit(0):
        assert extkv_tokens(second, BURST[:FEW], PARAMS) == expected[:FEW]
        status = second.kv_cache_status()
        assert status["num_blocks"] == status["num_blocks_floor"] and status["grow_held_back"]
        first_clock.now += IDLE_S
        first.engine.release_idle_kv_cache()
        status = first.kv_cache_status()
        assert status["num_blocks"] == status["num_blocks_floor"]
        assert extkv_tokens(second, BURST[:FEW], PARAMS) == expected[:FEW]
        status = second.kv_cache_status()
        assert status["num_blocks"] > status["num_blocks_floor"]
        assert not status["grow_held_back"]
    for llm in (first, second):
        assert_nothing_leaked(llm)
        llm.close()


def test_the_static_policy_is_the_default_and_shows_as_such(qwen3: Path) -> None:
    llm = LLM(qwen3, **OPTIONS)
    status = llm.kv_cache_status()
    assert status["policy"] == "static" and status["num_blocks_floor"] is None
    assert llm.engine.release_idle_kv_cache() is None
    assert llm.engine.scheduler.grow is None
    llm.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"kv_cache_policy": "dynamic"}, "kv_cache_policy must be one of 'static', 'elastic'; "),
        ({"kv_cache_policy": None}, "kv_cache_policy must be one of 'static', 'elastic'; got"),
        ({"kv_idle_release_s": 0}, r"kv_idle_release_s must be a number > 0; got 0"),
        ({"kv_idle_release_s": float("inf")}, "kv_idle_release_s must be a number > 0"),
        (
            {"kv_cache_policy": "elastic", "enable_extensible_kv_cache": False},
            r"kv_cache_policy='elastic' needs enable_extensible_kv_cache=True \(or 'auto'\)",
        ),
    ],
)
def test_bad_policy_options_are_refused_by_name(qwen3: Path, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(qwen3, **{**OPTIONS, **options})
