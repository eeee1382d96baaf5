"""Commit throughput of ExtensibleTensor vs torch.empty + zero_(), the time to give
committed memory back by physical allocation size, and kernel bandwidth over VMM memory
vs a plain allocation, side by side in one run (CUDA only).

    python benchmarks/bench_vmm.py [--sizes-gib 1 16 100] [--json OUT]

The release table decides what a level-1 sleep's KV release (123 GiB in 0.146 s on the
H200, in allocations of granules.MAX_ALLOCATION_BYTES) is made of: if it costs per
driver call, larger allocations free it faster; if per byte, nothing here will (the
H200's answer, 2026-12-05: per byte, about 1.5 TB/s). The threaded table then asks
whether releasing a cache's buffers from several threads at once is faster.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from _common import copy_bandwidth, write_json
from extkv import ExtensibleTensor
from extkv.vmm import granules

GiB = 1 << 30


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def commit_seconds(size: int, num_segments: int, zero_new: bool) -> float:
    buf = ExtensibleTensor(size, "cuda", num_segments=num_segments)
    try:
        return _timed(lambda: buf.resize_per_segment_(size // num_segments, zero_new=zero_new))
    finally:
        buf.free()


def torch_alloc_zero_seconds(size: int) -> float:
    holder: list[torch.Tensor] = []
    try:
        return _timed(
            lambda: holder.append(torch.empty(size, dtype=torch.uint8, device="cuda").zero_())
        )
    finally:
        holder.clear()
        torch.cuda.empty_cache()


def release_seconds(size: int, allocation_bytes: int) -> float:
    """Commit `size` bytes in physical allocations of at most `allocation_bytes`, then
    time giving all of them back (the shrink a sleep does)."""
    default = granules.MAX_ALLOCATION_BYTES
    granules.MAX_ALLOCATION_BYTES = allocation_bytes  # read when the tensor is made
    try:
        buf = ExtensibleTensor(size, "cuda")
    finally:
        granules.MAX_ALLOCATION_BYTES = default
    try:
        buf.resize_(size)
        return _timed(lambda: buf.shrink_per_segment_(0))
    finally:
        buf.free()


def threaded_release_seconds(size: int, num_buffers: int, threads: int) -> float:
    """Commit `size` bytes as `num_buffers` two-segment tensors (a KV cache's per-layer
    K/V buffers), then time giving them all back from `threads` threads: whether the
    driver's per-byte release cost runs in parallel (a sleep could then release its
    buffers side by side) or is serialised inside the driver."""
    part = size // num_buffers // 2 * 2
    buffers = [ExtensibleTensor(part, "cuda", num_segments=2) for _ in range(num_buffers)]
    try:
        for buf in buffers:
            buf.resize_per_segment_(part // 2)

        def release() -> None:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda buf: buf.shrink_per_segment_(0), buffers))

        return _timed(release)
    finally:
        for buf in buffers:
            buf.free()


def bandwidth_ratio(size: int) -> dict[str, float]:
    buf = ExtensibleTensor(2 * size, "cuda")
    try:
        view = buf.resize_(2 * size).view(torch.bfloat16)
        view.normal_()
        vmm = copy_bandwidth(view[: view.numel() // 2], view[view.numel() // 2 :])
    finally:
        buf.free()
    plain_src = torch.randn(size // 2, dtype=torch.bfloat16, device="cuda")
    plain_dst = torch.empty_like(plain_src)
    plain = copy_bandwidth(plain_src, plain_dst)
    del plain_src, plain_dst
    torch.cuda.empty_cache()
    return {"vmm_gbps": vmm / 1e9, "plain_gbps": plain / 1e9, "ratio": vmm / plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=int, nargs="+", default=[1, 16, 100])
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    ExtensibleTensor(1, "cuda").free()  # driver and context warm-up
    torch.empty(1, device="cuda").zero_()
    rows = []
    for gib in args.sizes_gib:
        size = gib * GiB
        baseline = torch_alloc_zero_seconds(size)
        for segments in (1, 2):
            for zero_new in (False, True):
                seconds = commit_seconds(size, segments, zero_new)
                rows.append(
                    {
                        "gib": gib,
                        "segments": segments,
                        "zero_new": zero_new,
                        "commit_s": round(seconds, 4),
                        "torch_empty_zero_s": round(baseline, 4),
                        "ratio_vs_torch": round(seconds / baseline, 3),
                    }
                )
    releases = [
        {
            "gib": gib,
            "allocation_gib": piece,
            "release_s": round(release_seconds(gib * GiB, piece * GiB), 4),
        }
        for gib in args.sizes_gib
        for piece in sorted({1, 4, gib})
        if piece <= gib
    ]
    largest = max(args.sizes_gib)
    threaded = [
        {
            "gib": largest,
            "buffers": 28,
            "threads": threads,
            "release_s": round(threaded_release_seconds(largest * GiB, 28, threads), 4),
        }
        for threads in (1, 4, 14)
    ]
    bandwidth = bandwidth_ratio(8 * GiB)
    print(f"{'GiB':>5} {'seg':>3} {'zero':>5} {'commit s':>9} {'torch s':>8} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['gib']:>5} {r['segments']:>3} {r['zero_new']!s:>5} {r['commit_s']:>9.4f} "
            f"{r['torch_empty_zero_s']:>8.4f} {r['ratio_vs_torch']:>6.3f}"
        )
    print(f"{'GiB':>5} {'alloc GiB':>9} {'release s':>9} {'GiB/s':>7}")
    for r in releases:
        rate = r["gib"] / max(r["release_s"], 1e-9)
        print(f"{r['gib']:>5} {r['allocation_gib']:>9} {r['release_s']:>9.4f} {rate:>7.0f}")
    print(f"{'GiB':>5} {'buffers':>7} {'threads':>7} {'release s':>9} {'GiB/s':>7}")
    for r in threaded:
        rate = r["gib"] / max(r["release_s"], 1e-9)
        print(
            f"{r['gib']:>5} {r['buffers']:>7} {r['threads']:>7} {r['release_s']:>9.4f} {rate:>7.0f}"
        )
    print(
        f"copy bandwidth 8 GiB: VMM {bandwidth['vmm_gbps']:.0f} GB/s, plain "
        f"{bandwidth['plain_gbps']:.0f} GB/s, ratio {bandwidth['ratio']:.3f}"
    )
    write_json(
        args.json,
        {"commit": rows, "release": releases, "threaded": threaded, "bandwidth": bandwidth},
    )


if __name__ == "__main__":
    main()
