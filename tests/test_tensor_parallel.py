"""Tensor parallelism: tensor_parallel_size=2 equals 1 token for token on the CPU (gloo),
legacy and extensible; the ranks agree on one block count; a worker that dies or hangs
makes the engine raise and leaves no process behind, one that is busy does not; bad sizes
and heartbeat timeouts are refused before any worker starts.
Models: Qwen3 (a KV head replicated on both ranks, a padded vocabulary), the Bamba
hybrid (attention and Mamba2 mixers split by heads and groups) and pure Mamba2."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from extkv import LLM, SamplingParams
from extkv.demo import QWEN3_0_6B_SHAPE, make_random_checkpoint
from extkv.engine.errors import EngineDeadError
from extkv.engine.workers import WorkerError
from helpers import children, extkv_tokens, started_children

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 100, 120], [17] * 3, list(range(30, 71)), [125, 3]]  # < Bamba's 128
QWEN3_OPTIONS = dict(cpu_memory_budget_bytes=128 << 20, max_model_len=128)
# 8 tokens a step: prompts are prefilled in chunks, the Mamba states carried between them.
MAMBA_OPTIONS = dict(
    cpu_memory_budget_bytes=64 << 20, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=8
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV head for 4 query heads (replicated on both ranks), and a vocabulary that
    two ranks split unevenly (padded)."""
    return make_random_checkpoint(
        tmp_path_factory.mktemp("qwen3-tp"),
        "qwen3",
        with_tokenizer=False,
        vocab_size=383,
        num_key_value_heads=1,
    )


_OLDER_CHILDREN: set[int] = set()


@pytest.fixture(autouse=True)
def older_children() -> None:
    """The children alive before each test (the session's live `extkv serve`s, which
    other modules started): not this test's to end."""
    _OLDER_CHILDREN.clear()
    _OLDER_CHILDREN.update(children())


def child_pids() -> set[int]:
    """The children started since the test began (see `started_children`)."""
    return started_children(_OLDER_CHILDREN)


def worker_pids() -> set[int]:
    """Children that are spawned workers."""
    return {pid for pid, cmdline in children().items() if b"spawn_main" in cmdline}


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
@pytest.mark.parametrize(
    ("family", "options"),
    [("qwen3", QWEN3_OPTIONS), ("bamba", MAMBA_OPTIONS), ("mamba2", MAMBA_OPTIONS)],
    ids=["qwen3", "bamba", "mamba2"],
)
def test_two_ranks_equal_one(
    family: str,
    options: dict,
    extensible: bool,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = request.getfixturevalue(family)
    expected = extkv_tokens(
        LLM(path, enable_extensible_kv_cache=extensible, **options), PROMPTS, GREEDY
    )
    assert len({tuple(t) for t in expected}) > 1
    with caplog.at_level(logging.INFO, logger="extkv"):
        llm = LLM(path, enable_extensible_kv_cache=extensible, tensor_parallel_size=2, **options)
    try:
        assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
        report = llm.memory_report()
        assert len(report["graph_pool_bytes_per_rank"]) == 2
        agreed = [r.getMessage() for r in caplog.records if "every rank uses" in r.getMessage()]
        assert agreed[-1].endswith(f"every rank uses {report['num_blocks']}.")
        assert llm.engine.block_manager.num_blocks == report["num_blocks"]
    finally:
        llm.close()
    assert not child_pids()


def test_eager_decode_on_two_ranks(qwen3: Path) -> None:
    """Without the static decode path every step goes to the workers as eager inputs."""
    expected = extkv_tokens(LLM(qwen3, enforce_eager=True, **QWEN3_OPTIONS), PROMPTS, GREEDY)
    llm = LLM(qwen3, enforce_eager=True, tensor_parallel_size=2, **QWEN3_OPTIONS)
    try:
        assert llm.engine.runner.graphs is None
        assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("family", "size", "match"),
    [
        ("qwen3", 0, r"tensor_parallel_size must be an int in \[1, 2\*\*63\)"),
        ("qwen3", True, r"tensor_parallel_size must be an int in \[1, 2\*\*63\)"),
        ("qwen3", 2.0, r"tensor_parallel_size must be an int in \[1, 2\*\*63\)"),
        ("qwen3", 3, r"tensor_parallel_size=3 must divide num_attention_heads \(4\)"),
        ("bamba", 4, r"tensor_parallel_size=4 must divide the Mamba groups \(n_groups\) \(2\)"),
    ],
)
def test_bad_sizes_are_refused_before_any_worker_starts(
    family: str, size: object, match: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(family)
    with pytest.raises(ValueError, match=match):
        LLM(path, tensor_parallel_size=size)
    assert not child_pids()


def test_worker_killed_during_startup_is_reported(qwen3: Path) -> None:
    killed: list[int] = []

    def kill_the_worker() -> None:
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for pid in worker_pids():
                time.sleep(0.2)  # spawned and handed its arguments: starting up
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_the_worker)
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        LLM(qwen3, tensor_parallel_size=2, **QWEN3_OPTIONS)
    elapsed = time.monotonic() - start
    killer.join()
    assert killed and elapsed < 30
    assert not child_pids()


def test_worker_killed_while_serving_is_reported(qwen3: Path) -> None:
    llm = LLM(qwen3, tensor_parallel_size=2, **QWEN3_OPTIONS)
    (pid,) = worker_pids()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
        extkv_tokens(llm, PROMPTS, GREEDY)
    assert time.monotonic() - start < 1  # the closed connection, not the heartbeat timeout
    assert not child_pids()
    with pytest.raises(EngineDeadError):  # the engine stays failed, it does not hang
        extkv_tokens(llm, PROMPTS, GREEDY)
    llm.close()


def test_hung_worker_is_reported(qwen3: Path) -> None:
    """A stopped worker keeps its connections open: without its heartbeat the driver would
    wait in the step's all-reduce for the 30-minute collective timeout."""
    llm = LLM(qwen3, tensor_parallel_size=2, worker_heartbeat_timeout=2, **QWEN3_OPTIONS)
    (pid,) = worker_pids()
    engine = llm.engine
    try:
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=100))
        engine.step()
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(
            EngineDeadError, match=rf"rank 1 \(pid {pid}\) missed its heartbeat for \d+\.\d s"
        ):
            while engine.has_unfinished_requests():
                engine.step()
        # Its last beat came up to a beat interval (0.5 s; more on a loaded machine) before.
        assert 1 <= time.monotonic() - start < 2 + 3
        assert not child_pids()
        with pytest.raises(EngineDeadError, match="missed its heartbeat"):
            extkv_tokens(llm, PROMPTS, GREEDY)  # the engine stays failed, it does not hang
    finally:
        if pid in worker_pids():
            os.kill(pid, signal.SIGKILL)  # a stopped process takes no other signal
        llm.close()
    assert not child_pids()


def test_busy_workers_are_not_taken_for_hung(qwen3: Path) -> None:
    """The heartbeat comes from a thread of its own: a worker whose main thread sits in
    a collective for several timeouts (here waiting for the next step, as in a long
    step) is not flagged, and serves the next step."""
    timeout = 1.0
    expected = extkv_tokens(LLM(qwen3, **QWEN3_OPTIONS), PROMPTS, GREEDY)
    llm = LLM(qwen3, tensor_parallel_size=2, worker_heartbeat_timeout=timeout, **QWEN3_OPTIONS)
    try:
        time.sleep(3 * timeout)
        assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
    finally:
        llm.close()
    assert not child_pids()


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), "2"])
def test_bad_heartbeat_timeouts_are_refused(qwen3: Path, timeout: object) -> None:
    with pytest.raises(ValueError, match=r"worker_heartbeat_timeout must be a number > 0"):
        LLM(qwen3, tensor_parallel_size=2, worker_heartbeat_timeout=timeout)
    assert not child_pids()


def test_runs_under_torchrun(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 ... --tensor-parallel-size 2`: rank 0 prints what one
    rank generates; rank 1 serves it and exits cleanly."""
    path = make_random_checkpoint(tmp_path / "model")
    options = ["--device", "cpu", "--max-model-len", "128", "--max-tokens", "8"]
    options += ["--cpu-memory-budget-bytes", str(128 << 20), "--ignore-eos"]
    llm = LLM(path, device="cpu", max_model_len=128, cpu_memory_budget_bytes=128 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = llm.generate(["The quick"], params, use_tqdm=False)[0].outputs[0].text
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "extkv.cli", "generate", "--model", str(path)]
    command += ["--prompt", "The quick", "--tensor-parallel-size", "2", *options]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(f"'The quick' -> {text!r}") == 1  # printed by rank 0 only


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_extensible_equals_legacy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Qwen3-0.6B shape over two GPUs (NCCL, CUDA graphs): extensible equals legacy
    exactly, each rank's graph memory and the common block count logged."""
    path = make_random_checkpoint(
        tmp_path, "qwen3", with_tokenizer=False, dtype=torch.bfloat16, **QWEN3_0_6B_SHAPE
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 151936, (n,), generator=gen).tolist() for n in (5, 300, 37, 120)]
    options = dict(tensor_parallel_size=2, max_model_len=1024, max_num_seqs=32)
    legacy = LLM(path, **options)
    expected = extkv_tokens(legacy, prompts, GREEDY)
    legacy.close()
    with caplog.at_level(logging.INFO, logger="extkv"):
        extensible = LLM(path, enable_extensible_kv_cache=True, **options)
    try:
        assert extkv_tokens(extensible, prompts, GREEDY) == expected
        report = extensible.memory_report()
        assert len(report["graph_pool_bytes_per_rank"]) == 2
        assert min(report["graph_pool_bytes_per_rank"]) > 0
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("CUDA graphs took") and "on ranks 0-1" in m for m in messages)
        assert any(m.endswith(f"every rank uses {report['num_blocks']}.") for m in messages)
    finally:
        extensible.close()
    assert not child_pids()
