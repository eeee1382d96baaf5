"""Pieces the benchmarks share: the 0.6B-shaped model, bandwidth, timing."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from extkv.demo import QWEN3_0_6B_SHAPE, make_random_checkpoint

logger = logging.getLogger(__name__)


def qwen3_0_6b_checkpoint(folder: str = "/tmp/extkv-bench/qwen3-0.6b") -> Path:
    """A random bf16 checkpoint of Qwen3-0.6B's shape, built once."""
    path = Path(folder)
    if not (path / "config.json").exists():
        logger.info("building a random Qwen3-0.6B-shaped checkpoint in %s", path)
        make_random_checkpoint(
            path, "qwen3", with_tokenizer=False, dtype=torch.bfloat16, **QWEN3_0_6B_SHAPE
        )
    return path


def copy_bandwidth(src: torch.Tensor, dst: torch.Tensor, repeats: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy (median of events)."""
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]


def device_bandwidth(gib: int = 4) -> float:
    src = torch.randn(gib << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    try:
        return copy_bandwidth(src, dst)
    finally:
        del src, dst
        torch.cuda.empty_cache()


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result
