"""The decode GEMV's memory bandwidth on each linear of Qwen3-0.6B and SmolLM2-135M,
against cuBLAS (F.linear), and (--sweep) the best tiling found by trying many.
`fused` is the GEMV with the step's fused input (RMSNorm + residual add before the
QKV and gate/up projections, SiLU*mul before the down projection) against `apart`,
the same two ops as separate kernels; the o projection has none.

    python benchmarks/bench_gemv.py [--rows 1 16] [--sweep] [--json OUT]

Each case runs as a CUDA graph of calls over enough copies of the weight (256 MiB in
all) that none of them is served from the 50 MB L2: a call's time is the graph's
replay time over its calls, launch gaps included, as in the captured decode step.
`GB/s` is the weight's bytes over that time; `of copy` divides by the device's copy
bandwidth (`_common.device_bandwidth`, read + write).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from _common import device_bandwidth, write_json
from extkv.kernels.activation import silu_and_mul
from extkv.kernels.gemv import (
    GemvConfig,
    gemv_config,
    linear_small_batch,
    rms_norm_linear_small_batch,
    silu_and_mul_linear_small_batch,
)
from extkv.kernels.norm import rms_norm

logger = logging.getLogger("bench_gemv")

# (name, K, N): the decode linears (QKV and gate/up merged); the step fuses an RMSNorm
# into those that read the residual stream and SiLU*mul into the down projections.
NORMED = ("qkv", "gate_up")
GATED = ("down",)
SHAPES = (
    ("qwen3 qkv", 1024, 4096),
    ("qwen3 o", 2048, 1024),
    ("qwen3 gate_up", 1024, 6144),
    ("qwen3 down", 3072, 1024),
    ("smollm2 qkv", 576, 960),
    ("smollm2 o", 576, 576),
    ("smollm2 gate_up", 576, 3072),
    ("smollm2 down", 1536, 576),
)
WEIGHT_BYTES = 256 << 20


def graph_time_us(fn, calls: int, replays: int = 5) -> float:
    """Microseconds per call of `fn(i)` for i < calls, captured once and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(i)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def candidate_configs(n: int, k: int) -> list[GemvConfig]:
    """The tilings --sweep tries: valid splits of K only."""
    configs = []
    for block_n, stage_bytes, split_k, num_stages, num_warps in itertools.product(
        (16, 32, 64), (8192, 16384, 32768), (1, 2, 4, 8), (4, 6, 8), (4,)
    ):
        block_k = min(stage_bytes // (2 * block_n), max(1 << (k - 1).bit_length(), 16))
        if split_k > 1 and k < split_k * block_k:
            continue
        configs.append(GemvConfig(block_n, block_k, split_k, num_warps, num_stages))
    return configs


def bench_shape(name: str, k: int, n: int, rows: int, sweep: bool, copy_gbs: float) -> dict:
    copies = max(4, min(512, math.ceil(WEIGHT_BYTES / (2 * n * k))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    gb = 2 * n * k / 1e9

    def figures(us: float) -> dict[str, float]:
        return {"us": us, "GB/s": gb / us * 1e6, "of copy": gb / us * 1e6 / copy_gbs}

    row = {"shape": name, "rows": rows}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = gemv_config(n, k, 2, sms)
    row["default"] = {
        **figures(graph_time_us(lambda i: linear_small_batch(x, weights[i], None), copies)),
        "config": str(default),
    }
    row["cublas"] = figures(graph_time_us(lambda i: F.linear(x, weights[i]), copies))
    if name.split()[-1] in NORMED + GATED:
        row["fused"], row["apart"] = fused_and_apart(name, x, weights, copies, figures)
    if sweep:
        timings = []
        for config in candidate_configs(n, k):
            try:
                us = graph_time_us(
                    lambda i, c=config: linear_small_batch(x, weights[i], None, c), copies
                )
            except OutOfResources:  # too many stages of too wide a tile
                continue
            timings.append((us, config))
        timings.sort(key=lambda t: t[0])
        row["best"] = {**figures(timings[0][0]), "config": str(timings[0][1])}
        row["top"] = [(round(us, 2), str(c)) for us, c in timings[:6]]
    logger.info("%s", row)
    return row


def fused_and_apart(name: str, x: torch.Tensor, weights: list, copies: int, figures) -> tuple:
    """The shape's fused GEMV and its two separate kernels, timed alike (the norm before
    NORMED linears, SiLU*mul before the others)."""
    rows, k = x.shape
    if name.split()[-1] in NORMED:
        residual = torch.randn_like(x)
        norm_weight = torch.rand(k, device=x.device, dtype=x.dtype) + 0.5

        def fused(i):
            return rms_norm_linear_small_batch(x, residual, norm_weight, 1e-6, weights[i])

        def apart(i):  # the norm adds x into the residual in place: it only grows here
            return linear_small_batch(rms_norm(x, norm_weight, 1e-6, residual)[0], weights[i])
    else:
        gate_up = torch.randn(rows, 2 * k, device=x.device, dtype=x.dtype)

        def fused(i):
            return silu_and_mul_linear_small_batch(gate_up, weights[i])

        def apart(i):
            return linear_small_batch(silu_and_mul(gate_up), weights[i])

    return figures(graph_time_us(fused, copies)), figures(graph_time_us(apart, copies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="x's rows (1-16)")
    parser.add_argument("--sweep", action="store_true", help="also try many tilings per shape")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    copy_gbs = device_bandwidth() / 1e9
    logger.info("device copy bandwidth %.0f GB/s", copy_gbs)
    rows = [
        bench_shape(name, k, n, m, args.sweep, copy_gbs) for m in args.rows for name, k, n in SHAPES
    ]
    print("== gemv: us per call (GB/s, of copy bandwidth)")
    for r in rows:
        line = f"{r['shape']:<16} m={r['rows']:<3}"
        for kind in ("default", "cublas", "fused", "apart", "best"):
            if kind in r:
                f = r[kind]
                line += f"  {kind} {f['us']:6.2f} ({f['GB/s']:5.0f}, {f['of copy']:.2f})"
        print(line)
        if "best" in r:
            print(f"{'':21}default {r['default']['config']}")
            for us, config in r["top"]:
                print(f"{'':21}{us:6.2f} {config}")
    write_json(args.json, {"copy_GB/s": copy_gbs, "rows": rows})


if __name__ == "__main__":
    main()
