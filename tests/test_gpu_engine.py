"""The engine on CUDA: graphs on, extensible equals legacy on the Qwen3-0.6B shape,
extkv greedy follows transformers greedy in bf16, and resizing and sleep keep the
graphs captured at start-up."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extkv import LLM
from extkv.demo import QWEN3_0_6B_SHAPE, make_random_checkpoint
from extkv.engine.weight_memory import WeightMemory
from helpers import assert_follows_transformers_in_bf16, extkv_tokens, greedy

pytestmark = pytest.mark.gpu

GREEDY = greedy(32)


@pytest.fixture(scope="module")
def qwen3_0_6b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-0.6b")
    return make_random_checkpoint(
        folder, "qwen3", with_tokenizer=False, dtype=torch.bfloat16, **QWEN3_0_6B_SHAPE
    )


@pytest.fixture(scope="module")
def small_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("small-qwen3"),
        "qwen3",
        with_tokenizer=False,
        dtype=torch.bfloat16,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        initializer_range=0.1,
    )


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 300, (n,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n_,), generator=gen).tolist() for n_ in lengths]


@pytest.mark.parametrize("backend", ["split", "block_major"])
def test_extensible_equals_legacy_with_cuda_graphs(
    qwen3_0_6b: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = random_prompts(24, QWEN3_0_6B_SHAPE["vocab_size"])
    options = dict(kv_layout=backend, max_model_len=1024, max_num_seqs=32)
    legacy = LLM(qwen3_0_6b, **options)
    assert legacy.engine.runner.graphs is not None  # graphs on
    expected = extkv_tokens(legacy, prompts, GREEDY)
    legacy_report = legacy.memory_report()
    legacy.close()
    with caplog.at_level(logging.INFO, logger="extkv"):
        extensible = LLM(qwen3_0_6b, enable_extensible_kv_cache=True, **options)
    messages = [r.getMessage() for r in caplog.records]
    reserve = next(i for i, m in enumerate(messages) if m.startswith("Reserved address space"))
    report = extensible.memory_report()
    extended = f"Extended KV cache to {report['num_blocks']} blocks. "
    assert any(i > reserve for i, m in enumerate(messages) if m.startswith(extended))
    assert extkv_tokens(extensible, prompts, GREEDY) == expected
    assert report["graph_pool_bytes"] > 0
    # Sized from what the capture really took: within 1% of the physical limit, never past it.
    target = report["available_bytes"] - report["graph_pool_bytes"] - report["margin_bytes"]
    assert 0.99 * target <= report["kv_cache_bytes"] <= target
    assert legacy_report["graph_pool_estimate_bytes"] > 0  # legacy had to guess
    extensible.close()


def test_greedy_follows_transformers_in_bf16(small_qwen3: Path) -> None:
    """Tokens equal transformers' for the first 16 generated tokens, or the first
    divergence is a near-tie of transformers' own logits."""
    prompts = random_prompts(8, 4096, seed=1)
    llm = LLM(small_qwen3, max_model_len=512, max_num_seqs=16)
    ours = extkv_tokens(llm, prompts, greedy(16))
    llm.close()
    assert_follows_transformers_in_bf16(small_qwen3, prompts, ours, tolerance=0.02)


@pytest.mark.parametrize(
    ("persistent", "attention"), [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
)
def test_one_sequence_at_a_time_follows_transformers_in_bf16(
    small_qwen3: Path, monkeypatch: pytest.MonkeyPatch, persistent: str, attention: str
) -> None:
    """Batch-1 decode steps (captured in graphs) follow transformers as the batched ones
    do: the MLP by the GEMVs (EXTKV_PERSISTENT=0) and by the one-row MLP kernel (1), the
    attention by three kernels (EXTKV_DECODE_ATTENTION=0) and by one (1)."""
    monkeypatch.setenv("EXTKV_PERSISTENT", persistent)
    monkeypatch.setenv("EXTKV_DECODE_ATTENTION", attention)
    prompts = random_prompts(3, 4096, seed=2)
    llm = LLM(small_qwen3, max_model_len=512, max_num_seqs=1)
    assert llm.engine.runner.graphs is not None
    ours = extkv_tokens(llm, prompts, greedy(16))
    llm.close()
    assert_follows_transformers_in_bf16(small_qwen3, prompts, ours, tolerance=0.02)


def test_resize_and_sleep_keep_the_graphs_captured_at_start_up(small_qwen3: Path) -> None:
    """Elastic memory on the device: after a resize down and up and a sleep at each level,
    the decode graphs captured at start-up (the same objects: nothing is captured again)
    give the same tokens, and sleep frees on the device what it says it gives back."""
    prompts = random_prompts(8, 4096, seed=2)
    options = dict(max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.3)
    llm = LLM(small_qwen3, enable_extensible_kv_cache=True, enable_sleep_mode=True, **options)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    expected = extkv_tokens(llm, prompts, GREEDY)
    blocks = llm.kv_cache_status()["num_blocks"]
    shrunk = llm.resize_kv_cache(num_blocks=blocks // 4)
    assert shrunk["committed_bytes"] < shrunk["previous_committed_bytes"]
    assert extkv_tokens(llm, prompts, GREEDY) == expected
    assert llm.resize_kv_cache(num_blocks=blocks)["num_blocks"] == blocks
    for level in (1, 2):
        engine = llm.engine
        released = engine.kv_cache.committed_bytes + engine.runner.weights.committed_bytes
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        llm.sleep(level=level)
        assert torch.cuda.mem_get_info()[0] - free_before >= 0.9 * released
        llm.wake_up()
        assert extkv_tokens(llm, prompts, GREEDY) == expected
    assert llm.engine.runner.graphs is graphs
    llm.close()


def test_level_one_sleep_fills_the_host_copy_pinned_at_start_up() -> None:
    """Sleep mode pins the weights' host copy when it moves them (pinning is ~20x slower
    than the copy): every level-1 sleep fills that same page-locked buffer, wake gives
    the weights back bit for bit, and `free` unregisters the buffer with the driver."""
    model = torch.nn.Linear(1024, 4096, dtype=torch.bfloat16, device="cuda:0")
    memory = WeightMemory(model, torch.device("cuda:0"))
    host = memory._host_copy
    assert host is not None and host.is_pinned() and host.numel() == memory.num_bytes
    before = model.weight.detach().clone()
    for _ in range(2):
        memory.offload(keep_parameters=True)
        assert memory.committed_bytes == 0 and memory._saved is host
        assert memory.restore() is False
        assert torch.equal(model.weight, before)
    memory.free()
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)) == 0  # was released
    cudart.cudaHostUnregister(host.data_ptr())


def test_torchs_cache_before_start_up_is_not_budgeted_twice(small_qwen3: Path) -> None:
    """Memory torch caches in this process but no tensor uses (a checkpoint just built on
    the device) is not another's: the engine takes no more than gpu_memory_utilization
    of the device (before, it counted the cache as held by others, gave it back while
    profiling and then sized the KV cache into it as well)."""
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    torch.empty(4 << 30, dtype=torch.uint8, device="cuda")  # freed at once, still cached
    utilization = 0.3
    llm = LLM(
        small_qwen3,
        enable_extensible_kv_cache=True,
        gpu_memory_utilization=utilization,
        max_model_len=512,
        max_num_seqs=16,
    )
    taken = free_before - torch.cuda.mem_get_info()[0]
    assert 0.9 * utilization * total <= taken <= utilization * total
    llm.close()


ACTIVATION_HOLD_SCRIPT = """
import json, sys, torch
from extkv import LLM

def cached():
    return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

options = dict(max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.3)
llm = LLM(sys.argv[1], enable_extensible_kv_cache=True, enable_sleep_mode=True, **options)
seen = dict(peak=llm.memory_report()["activation_peak_bytes"], awake=cached())
llm.sleep(level=1)
seen["asleep"] = cached()
llm.wake_up()
seen["woken"] = cached()
llm.close()
print(json.dumps(seen))
"""


def test_the_activation_peak_stays_in_torchs_cache_except_asleep(small_qwen3: Path) -> None:
    """After start-up torch's allocator keeps the profiled activation peak cached (eager
    steps take it from there, not from a driver another engine may have drained); sleep
    gives it back to the driver with the rest, wake takes it again. In a process of its
    own: what earlier tests left in torch's cache would blur the counts."""
    done = subprocess.run(
        [sys.executable, "-c", ACTIVATION_HOLD_SCRIPT, str(small_qwen3)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    peak = seen["peak"]
    assert peak > 0 and seen["awake"] >= peak  # also what the graphs' pool holds free
    assert seen["awake"] - seen["asleep"] >= peak
    assert seen["woken"] - seen["asleep"] >= peak
