"""Paged attention: decode (how fast it reads the KV cache) on the Qwen3-0.6B and the
SmolLM2-135M head shapes, and (--prefill) causal prefill of 1 x 8192 and 4 x 2048 new
tokens on Qwen3-0.6B's, with the engine's launch choices and (--sweep) the best tiles
and split counts found by trying many.

    python benchmarks/bench_attention.py [--batch-sizes 1 256] [--context 544] [--sweep]
    python benchmarks/bench_attention.py --prefill [--sweep]

Each sequence's context sits on randomly scattered 16-token blocks of one layer's
cache (split layout, bf16); a case runs as a CUDA graph of 10 calls (prefill: 3),
replayed. `GB/s` is the K and V bytes a decode call must read over its time;
`TFLOP/s` counts a prefill's causal QK^T and PV as 2 x heads x head_dim x L^2 per
sequence of L tokens (bench_prefill's count).

A prefill is measured twice in one run: the paged kernel over the cache, and the
prefill kernel over the step's own K/V (what the engine runs for prompts with nothing
cached: k a tensor of its own, v a view of the fused qkv rows), with their ratio;
--sweep tries the tiles of both, the prefill kernel's with TMA loads and without.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from collections.abc import Callable
from functools import partial

import torch
from triton.runtime.errors import OutOfResources

from bench_gemv import graph_time_us
from extkv.attention.metadata import AttentionMetadata
from extkv.kernels import prefill_attention as own_kv
from extkv.kernels.paged_attention import (
    DECODE_TILES,
    PREFILL_TILES,
    Tiles,
    decode_splits,
    paged_attention,
)

logger = logging.getLogger("bench_attention")

HEADS = {"qwen3-0.6b": (16, 8, 128), "smollm2-135m": (9, 3, 64)}  # q heads, KV heads, dim
BLOCK_SIZE = 16
CALLS = 10


def paged_case(batch: int, context: int, q_len: int, num_kv_heads: int, head_dim: int):
    """A cache and the metadata of one step over it: `q_len` new tokens per sequence
    (1: decode; `context`: a prefill without a cached prefix)."""
    pages = -(-context // BLOCK_SIZE)
    num_blocks = batch * pages + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * pages].view(batch, pages)
    metadata = AttentionMetadata(
        is_prefill=q_len > 1,
        slot_mapping=torch.full((batch * q_len,), -1, device="cuda"),
        cu_seqlens_q=torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q_len,
        context_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        max_seqlen_q=q_len,
        max_context_len=context,
    )
    return k_cache, v_cache, metadata


def bench_case(name: str, batch: int, context: int, sweep: bool) -> dict:
    num_q_heads, num_kv_heads, head_dim = HEADS[name]
    k_cache, v_cache, metadata = paged_case(batch, context, 1, num_kv_heads, head_dim)
    query = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)
    gb = 2 * batch * context * num_kv_heads * head_dim * 2 / 1e9

    def time_us(splits: int | None = None, tiles: Tiles | None = None) -> float:
        def call(_: int) -> None:
            paged_attention(query, k_cache, v_cache, metadata, 0.1, out, splits, tiles)

        return graph_time_us(call, CALLS)

    width = metadata.block_tables.shape[1] * BLOCK_SIZE
    splits = decode_splits(batch, num_kv_heads, width, query.device)
    us = time_us()
    row = {"case": f"{name} b{batch}", "default": {"us": us, "GB/s": gb / us * 1e6}}
    row["default"]["config"] = f"{DECODE_TILES}, splits={splits}"
    if sweep:
        candidates = {
            f"{tiles}, splits={splits}": partial(time_us, splits, tiles)
            for block_n, num_warps, num_stages, splits in itertools.product(
                (64, 128), (4, 8), (2, 3), (1, 2, 4, 8)
            )
            for tiles in [Tiles(DECODE_TILES.block_m, block_n, num_warps, num_stages)]
        }
        row["top"] = fastest(candidates, lambda us: gb / us * 1e6)
    logger.info("%s", row)
    return row


def fastest(
    candidates: dict[str, Callable[[], float]], rate: Callable[[float], float]
) -> list[tuple[float, int, str]]:
    """The five fastest of the launches `candidates` times (us), with their `rate`; a
    launch whose tiles do not fit shared memory is left out."""
    timings = []
    for config, time_us in candidates.items():
        try:
            timings.append((time_us(), config))
        except OutOfResources:
            continue
    timings.sort()
    return [(round(t, 2), round(rate(t)), config) for t, config in timings[:5]]


def bench_prefill_case(batch: int, length: int, sweep: bool) -> dict:
    """One layer's causal prefill of `batch` sequences of `length` new tokens (Qwen3-0.6B's
    heads): the paged kernel at PREFILL_TILES and the prefill kernel over the step's own
    K/V at its tiles, their ratio, and (sweep) the five fastest of many tiles of each."""
    num_q_heads, num_kv_heads, head_dim = HEADS["qwen3-0.6b"]
    k_cache, v_cache, metadata = paged_case(batch, length, length, num_kv_heads, head_dim)
    num_tokens = batch * length
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, device="cuda")
    qkv = qkv.bfloat16()
    query = qkv[:, :num_q_heads].contiguous()
    keys = qkv[:, num_q_heads : num_q_heads + num_kv_heads].contiguous()
    values = qkv[:, num_q_heads + num_kv_heads :]
    out = torch.empty_like(query)
    tflop = 2 * num_q_heads * head_dim * length**2 * batch / 1e12

    def paged_us(tiles: Tiles) -> float:
        def call(_: int) -> None:
            paged_attention(query, k_cache, v_cache, metadata, 0.1, out, tiles=tiles)

        return graph_time_us(call, 3)

    def own_us(tiles: Tiles | None, use_tma: bool | None = None) -> float:
        def call(_: int) -> None:
            own_kv.prefill_attention(
                query, keys, values, metadata.cu_seqlens_q, length, 0.1, None, out, tiles, use_tma
            )

        return graph_time_us(call, 3)

    def result(us: float, config: str) -> dict:
        return {"us": us, "TFLOP/s": tflop / us * 1e6, "config": config}

    row = {"case": f"prefill {batch}x{length}"}
    row["default"] = result(paged_us(PREFILL_TILES), f"paged {PREFILL_TILES}")
    row["own_kv"] = result(own_us(None), f"own K/V {own_kv.PREFILL_TILES}, tma=auto")
    row["speedup"] = row["default"]["us"] / row["own_kv"]["us"]
    if sweep:
        tiles = list(
            itertools.starmap(Tiles, itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))
        )

        def rate(us: float) -> float:
            return tflop / us * 1e6

        row["top"] = fastest({f"paged {t}": partial(paged_us, t) for t in tiles}, rate)
        row["own_kv_top"] = fastest(
            {
                f"own K/V {t}, tma={tma}": partial(own_us, t, tma)
                for t in tiles
                for tma in (True, False)
                if t.block_n >= 64
            },
            rate,
        )
    logger.info("%s", row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=544, help="tokens per sequence")
    parser.add_argument("--sweep", action="store_true", help="also try many tiles and splits")
    parser.add_argument("--prefill", action="store_true", help="causal prefill, not decode")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.prefill:
        rows = [bench_prefill_case(b, n, args.sweep) for b, n in ((1, 8192), (4, 2048))]
        title, unit = "causal prefill, one layer, us per call (TFLOP/s)", "TFLOP/s"
    else:
        rows = [
            bench_case(name, batch, args.context, args.sweep)
            for batch in args.batch_sizes
            for name in HEADS
        ]
        title = f"decode, {args.context} tokens per sequence, us per call (GB/s)"
        unit = "GB/s"
    print(f"== attention: {title}")
    for r in rows:
        for key, top in (("default", "top"), ("own_kv", "own_kv_top")):
            if key not in r:
                continue
            d = r[key]
            case = r["case"] if key == "default" else ""
            print(f"{case:<18} {d['us']:7.2f} ({d[unit]:5.0f})  {d['config']}")
            for us, rate, config in r.get(top, []):
                print(f"{'':18} {us:7.2f} ({rate:5.0f})  {config}")
        if "speedup" in r:
            print(f"{'':18} own K/V vs paged: {r['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
