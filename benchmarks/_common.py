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


def random_prompts(batch: int, vocab: int, length: int, seed: int | None = None) -> list[list[int]]:
    """`batch` prompts of `length` token ids in [1, vocab), seeded by `seed` (default: `batch`)."""
    gen = torch.Generator().manual_seed(batch if seed is None else seed)
    return torch.randint(1, vocab, (batch, length), generator=gen).tolist()


def _throughput(run, batch: int, output_len: int) -> tuple[float, float]:
    """(end-to-end output tokens/s, decode-only tokens/s): a full run against a
    one-token run of the same prompts, so the prefill drops out of the second."""
    run(2)  # warm-up
    t_one, _ = timed(lambda: run(1))
    t_all, _ = timed(lambda: run(output_len))
    return batch * output_len / t_all, batch * (output_len - 1) / (t_all - t_one)


def decode_throughput(llm, batch: int, vocab: int, prompt_len: int, output_len: int):
    from extkv import SamplingParams

    ids = random_prompts(batch, vocab, prompt_len)

    def run(n: int):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)

    return _throughput(run, batch, output_len)


def hf_decode_throughput(model, batch: int, vocab: int, prompt_len: int, output_len: int):
    ids = torch.tensor(random_prompts(batch, vocab, prompt_len), device="cuda")
    mask = torch.ones_like(ids)

    def run(n: int):
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    return _throughput(run, batch, output_len)
