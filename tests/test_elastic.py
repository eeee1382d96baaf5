"""Elastic memory on the CPU (host backend, tiny random Qwen3): the KV cache resized while
requests decode, and the engine put to sleep and woken, leave greedy tokens unchanged,
leak no block and no granule, keep the prefix cache right, and really give memory back."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from extkv.engine.errors import EngineAsleepError, EngineStateError
from extkv.engine.host_memory import resident_bytes
from helpers import (
    ELASTIC_OPTIONS,
    ELASTIC_PARAMS,
    ELASTIC_PROMPTS,
    MIN_BLOCKS,
    assert_nothing_leaked,
    decode_through,
    extkv_tokens,
    resize_while_decoding,
)

OPTIONS = {**ELASTIC_OPTIONS, "cpu_memory_budget_bytes": 96 << 20}


class Served(NamedTuple):
    llm: LLM
    expected: list[list[int]]  # ELASTIC_PROMPTS' tokens before any resize or sleep


@pytest.fixture(scope="module")
def served(qwen3: Path) -> Served:
    llm = LLM(qwen3, enable_sleep_mode=True, enable_prefix_caching=True, **OPTIONS)
    return Served(llm, extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS))


def test_resizing_while_decoding_keeps_tokens_moving_or_preempting(served: Served) -> None:
    llm, expected = served
    reports = resize_while_decoding(llm, expected)
    assert reports[1]["previous_num_blocks"] == 12
    # The moved blocks' prefix-cache entries name their new places: hits give the same tokens.
    cached = llm.engine.block_manager.num_cached_tokens
    assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
    assert llm.engine.block_manager.num_cached_tokens > cached
    assert llm.kv_cache_status()["num_resizes"]["shrink"] >= 2


def test_resizing_moves_blocks_in_every_kv_cache_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3: two local groups (window 12) and a global one draw from one pool. A shrink
    while decoding moves the blocks past the new end whichever group holds them (a local
    table's released entries stay released), a deeper one preempts; the tokens stay those
    of the engine before any resize, and every group gives all its blocks back."""
    path = make_random_checkpoint(tmp_path, "gemma3", with_tokenizer=False)
    llm = LLM(path, **OPTIONS)
    expected = extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS)
    blocks = llm.engine.block_manager
    assert [g.kind for g in blocks.groups] == ["sliding_window"] * 2 + ["full_attention"]
    least = llm.kv_cache_status()["min_blocks"]
    assert least == 3 * 128 // 16  # prefills of 256 tokens: no window bound below the length
    llm.resize_kv_cache(num_blocks=64)
    moving = set()  # groups holding a block past the end of a shrink
    resize = llm.resize_kv_cache

    def recording(num_blocks: int) -> dict[str, object]:
        for seq in llm.engine.scheduler.running:
            tables = enumerate(seq.block_tables)
            moving.update(g for g, table in tables if any(b >= num_blocks for b in table))
        return resize(num_blocks=num_blocks)

    monkeypatch.setattr(llm, "resize_kv_cache", recording)
    schedule = [(3, {"num_blocks": 30}), (6, {"num_blocks": 60}), (20, {"num_blocks": least})]
    tokens, reports = decode_through(
        llm, ELASTIC_PROMPTS, ELASTIC_PARAMS, schedule, hog=list(range(300, 360))
    )
    assert tokens == expected
    assert reports[0]["num_moved_blocks"] > 0 and moving == {0, 1, 2}
    assert reports[2]["num_preempted"] > 0
    assert llm.kv_cache_status()["num_blocks_used_by_group"] == [0, 0, 0]
    assert_nothing_leaked(llm)


SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # ELASTIC_PARAMS' first 12


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    start=st.integers(MIN_BLOCKS, 64),
    schedule=st.lists(
        st.tuples(
            st.integers(0, 14),
            st.one_of(
                st.builds(dict, num_blocks=st.integers(MIN_BLOCKS, 96)),
                st.builds(dict, memory_bytes=st.integers(8 << 20, 24 << 20)),
            ),
        ),
        max_size=4,
    ),
)
def test_random_resize_schedules_never_change_tokens_or_leak(
    served: Served, start: int, schedule: list[tuple[int, dict[str, int]]]
) -> None:
    llm, expected = served
    llm.resize_kv_cache(num_blocks=start)
    tokens, reports = decode_through(llm, ELASTIC_PROMPTS, SHORT, schedule)
    assert tokens == [t[:12] for t in expected]
    for report in reports:
        assert report["num_blocks"] == report["requested_blocks"]  # host memory: all fits
    assert_nothing_leaked(llm)


def test_memory_bytes_rounds_down_to_whole_blocks_and_granules(served: Served) -> None:
    llm = served.llm
    cache = llm.engine.kv_cache
    budget = (16 << 20) + 12345
    report = llm.resize_kv_cache(memory_bytes=budget)
    assert report["committed_bytes"] == cache.committed_bytes <= budget
    assert report["committed_bytes"] % (2 << 20) == 0  # whole granules
    blocks = report["num_blocks"]
    assert blocks == cache.num_blocks == cache.blocks_within(budget) > MIN_BLOCKS
    assert llm.resize_kv_cache(num_blocks=blocks + 1)["committed_bytes"] > budget  # the most
    status = llm.kv_cache_status()
    assert status["committed_bytes"] == cache.committed_bytes < status["reserved_bytes"]
    assert status["num_blocks_used"] == 0 and status["asleep"] == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "exactly one of num_blocks or memory_bytes"),
        ({"num_blocks": 9, "memory_bytes": 1 << 20}, ValueError, "exactly one"),
        ({"num_blocks": 0}, ValueError, r"num_blocks must be an int in \[1, 2\*\*63\); got 0"),
        ({"num_blocks": True}, ValueError, "num_blocks must be an int"),
        ({"memory_bytes": -1}, ValueError, "memory_bytes must be an int"),
        ({"num_blocks": 7}, ValueError, "fewer than the 8 blocks one sequence of max_model_len"),
        ({"memory_bytes": 1 << 20}, ValueError, "memory_bytes=1048576 holds 0 blocks: fewer"),
        ({"num_blocks": 10**9}, ValueError, "more than the .* blocks the KV cache's address"),
    ],
)
def test_bad_resizes_are_refused_and_change_nothing(
    served: Served, kwargs: dict, error: type, match: str
) -> None:
    llm = served.llm
    before = llm.kv_cache_status()
    with pytest.raises(error, match=match):
        llm.resize_kv_cache(**kwargs)
    assert llm.kv_cache_status() == before


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_addresses_and_tokens_and_reset_the_prefix_cache(
    served: Served, level: int
) -> None:
    llm, expected = served
    engine = llm.engine
    llm.resize_kv_cache(num_blocks=64)
    assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected  # fills the prefix cache
    weights = [p.data_ptr() for p in engine.runner.model.parameters()]
    views = {name: view.data_ptr() for name, view in engine.kv_cache.layer_views.items()}
    llm.sleep(level=level)
    assert llm.is_sleeping()
    assert engine.kv_cache.committed_bytes == engine.runner.weights.committed_bytes == 0
    with pytest.raises(EngineAsleepError, match="asleep"):
        llm.generate(
            prompt_token_ids=ELASTIC_PROMPTS[:1], sampling_params=ELASTIC_PARAMS, use_tqdm=False
        )
    with pytest.raises(EngineStateError, match="already asleep"):
        llm.sleep()
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and llm.kv_cache_status()["asleep"] == ["kv_cache"]
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert [p.data_ptr() for p in engine.runner.model.parameters()] == weights
    assert {n: v.data_ptr() for n, v in engine.kv_cache.layer_views.items()} == views
    assert llm.kv_cache_status()["num_blocks"] == 64
    cached = engine.block_manager.num_cached_tokens
    assert extkv_tokens(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS) == expected
    assert engine.block_manager.num_cached_tokens == cached  # nothing stale was hit
    llm.wake_up()  # awake already: nothing to do


def test_sleep_refuses_requests_in_flight_or_drains_them(served: Served) -> None:
    llm, expected = served
    engine = llm.engine
    request = engine.add_request(ELASTIC_PROMPTS[0], ELASTIC_PARAMS)
    engine.step()
    with pytest.raises(EngineStateError, match=r"1 request\(s\) in flight.*drain=True"):
        llm.sleep()
    [output] = llm.sleep(drain=True)
    assert (output.request_id, output.outputs[0].token_ids) == (request, expected[0])
    assert llm.is_sleeping()
    llm.wake_up()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda llm: llm.sleep(level=3), r"level must be one of 1, 2; got 3"),
        (lambda llm: llm.sleep(level="1"), "level must be one of 1, 2"),
        (lambda llm: llm.wake_up(tags=["gpu"]), "tags must be None or a list of weights and"),
        (lambda llm: llm.wake_up(tags="weights"), "tags must be None or a list"),
    ],
)
def test_bad_sleep_and_wake_arguments(served: Served, call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(served.llm)
    assert not served.llm.is_sleeping()


def test_sleep_mode_needs_the_extensible_cache_and_resizing_needs_it_too(qwen3: Path) -> None:
    with pytest.raises(ValueError, match="enable_sleep_mode needs enable_extensible_kv_cache"):
        LLM(qwen3, enable_sleep_mode=True, **{**OPTIONS, "enable_extensible_kv_cache": False})
    legacy = LLM(qwen3, **{**OPTIONS, "enable_extensible_kv_cache": False})
    with pytest.raises(EngineStateError, match="needs the extensible KV cache"):
        legacy.resize_kv_cache(num_blocks=MIN_BLOCKS)
    with pytest.raises(EngineStateError, match="enable_sleep_mode=True"):
        legacy.sleep()
    with pytest.raises(EngineStateError, match="enable_sleep_mode=True"):
        legacy.wake_up()
    assert not legacy.is_sleeping()
    legacy.close()


@pytest.fixture(scope="module")
def heavy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights big enough to see in the resident set: 2 x 65536 x 64 fp32 is 32 MiB."""
    return make_random_checkpoint(
        tmp_path_factory.mktemp("heavy"),
        vocab_size=65536,
        tie_word_embeddings=False,
        with_tokenizer=False,
    )


def test_sleep_gives_the_memory_back(heavy: Path) -> None:
    """The resident set falls by the KV cache (level 1: the weights move to host memory, no
    net change on the CPU) and by the KV cache and the weights (level 2)."""
    llm = LLM(heavy, enable_sleep_mode=True, **OPTIONS)
    engine = llm.engine
    expected = extkv_tokens(llm, ELASTIC_PROMPTS[2:], ELASTIC_PARAMS)
    kv, weights = engine.kv_cache.committed_bytes, engine.runner.weights.committed_bytes
    assert weights >= 32 << 20 and kv >= 16 << 20
    drops = {}
    for level in (1, 2):
        gc.collect()  # earlier tests' garbage, freed now rather than while measuring
        before = resident_bytes()
        llm.sleep(level=level)
        drops[level] = before - resident_bytes()
        llm.wake_up()
        assert extkv_tokens(llm, ELASTIC_PROMPTS[2:], ELASTIC_PARAMS) == expected
    # 0.8: the granules at each segment's end are committed but only partly touched, and
    # the level-1 host copy of the weights faults its pages in as the region's go.
    assert drops[1] >= 0.8 * kv
    assert drops[2] >= 0.8 * (kv + weights)
    llm.close()
