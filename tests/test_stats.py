"""The engine's published stats follow what it does: blocks held while requests run,
released after; steps and preemptions counted."""

from __future__ import annotations

from pathlib import Path

from extkv import LLM, SamplingParams

SMALL = dict(cpu_memory_budget_bytes=64 << 20, max_model_len=128, max_num_seqs=4)


def test_stats_track_blocks_requests_and_steps(qwen3: Path) -> None:
    llm = LLM(qwen3, **SMALL)
    engine = llm.engine
    idle = engine.stats()
    report = llm.memory_report()
    assert idle.num_blocks_committed == report["num_blocks_committed"]
    assert idle.num_blocks_capacity == report["num_blocks_capacity"]
    assert idle.kv_committed_bytes == report["kv_cache_bytes"]
    assert idle.num_blocks_used == idle.num_running == idle.num_waiting == idle.num_steps == 0
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for prompt in ([1, 2, 3], list(range(40))):
        engine.add_request(prompt, params)
    assert engine.stats().num_waiting == 2
    engine.step()
    busy = engine.stats()
    assert busy.num_running == 2 and busy.num_waiting == 0
    assert busy.num_blocks_used == 1 + 3  # 3 tokens: one 16-token block; 40 tokens: three
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.stats()
    assert done.num_blocks_used == done.num_running == 0
    assert done.num_steps == 1 + 4  # one prefill, then a decode for each token after the first
