"""The block pool's bookkeeping cost as blocks cycle through it: microseconds per block
taken, early and after many blocks have been taken and freed (CPU, no model).

    python benchmarks/bench_block_pool.py [--num-blocks 872038] [--baseline-src DIR]
        [--json OUT]
    python benchmarks/bench_block_pool.py --smoke   # a small pool: proves it runs

A serving engine takes blocks from the free pool and gives them back for as long as it
runs, so what a take costs must not grow with the blocks taken before. The pool here is
Gemma3-1B's on the H200 (872,038 blocks in the kinds benchmark) with one full-attention
and one sliding-window group, as its model has. Sequences of `--blocks-per-seq` blocks
are allocated and freed in turn, FIFO through the pool as decode steps use it; each row
times `--window` such cycles after `after` blocks have gone through.

The resize rows time the scheduler's pool resize (`Scheduler.resize`, idle, no block
held) in ms: to 0 blocks and back, as a sleep and its wake do it, and down and up by
`--resize-blocks` (about 1 GiB of Qwen3-0.6B's KV cache, what the elastic policy gives
back or takes at a time). Then the same on a pool of `--sleep-blocks` (Qwen3-0.6B's
KV cache at 0.9 of the H200).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from _common import Column, Rows, benchmark_parser, measure_and_report
from extkv import SamplingParams
from extkv.engine.block_manager import BlockManager
from extkv.engine.scheduler import Scheduler
from extkv.engine.sequence import Sequence
from extkv.kv_cache import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

COLUMNS: list[Column] = [("us_per_block", "us/block", ".3f"), ("ms", "ms", ".2f")]
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Setting:
    num_blocks: int = 872_038
    blocks_per_seq: int = 8
    window: int = 2_000  # cycles timed per row
    afters: tuple[int, ...] = (0, 100_000, 400_000)  # blocks taken before a row's window
    resize_blocks: int = 585  # 1 GiB of Qwen3-0.6B's KV cache (1.75 MiB a block)
    sleep_blocks: int = 70_000  # Qwen3-0.6B's KV cache at 0.9 of the H200 (about 123 GiB)


SMOKE = Setting(num_blocks=4_096, window=100, afters=(0, 4_000), resize_blocks=64, sleep_blocks=512)


def _groups() -> list[KVCacheGroup]:
    """One full-attention and one 512-token sliding-window group (Gemma 3's two kinds)."""
    full = FullAttentionSpec(BLOCK_SIZE, 1, 256, torch.bfloat16)
    local = SlidingWindowSpec(BLOCK_SIZE, 1, 256, torch.bfloat16, 512)
    return [KVCacheGroup(["global"], full), KVCacheGroup(["local"], local)]


def measure(args) -> Rows:
    setting = SMOKE
    if not args.smoke:
        setting = Setting(
            args.num_blocks, resize_blocks=args.resize_blocks, sleep_blocks=args.sleep_blocks
        )
    manager = BlockManager(setting.num_blocks, _groups())
    tokens = [1] * (setting.blocks_per_seq * BLOCK_SIZE)
    per_cycle = setting.blocks_per_seq * len(manager.groups)  # blocks taken per cycle

    def cycles(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            seq = Sequence("r", tokens, SamplingParams())
            manager.allocate(seq, len(tokens))
            manager.free(seq)
        return time.perf_counter() - start

    rows: Rows = {}
    taken = 0
    for after in setting.afters:
        count = max(-(-(after - taken) // per_cycle), 0)  # cycles that reach `after`
        cycles(count)
        taken += count * per_cycle
        seconds = cycles(setting.window)
        taken += setting.window * per_cycle
        rows[f"after {after:,} blocks"] = {
            "us_per_block": seconds / (setting.window * per_cycle) * 1e6
        }
    for num_blocks in (setting.num_blocks, setting.sleep_blocks):
        rows |= resize_rows(num_blocks, setting.resize_blocks)
    return rows


def resize_rows(num_blocks: int, step: int) -> Rows:
    """ms to resize an idle pool of `num_blocks` to 0 and back, then down and up by `step`."""
    scheduler = Scheduler(BlockManager(num_blocks, _groups()), 256, 8192, 4096, frozenset())
    rows: Rows = {}
    for case, target in [
        ("to 0 (sleep)", 0),
        ("back (wake)", num_blocks),
        (f"down {step}", num_blocks - step),
        (f"up {step}", num_blocks),
    ]:
        start = time.perf_counter()
        scheduler.resize(target)
        rows[f"{num_blocks:,}: {case}"] = {"ms": (time.perf_counter() - start) * 1e3}
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--num-blocks", type=int, default=Setting.num_blocks)
    parser.add_argument("--resize-blocks", type=int, default=Setting.resize_blocks)
    parser.add_argument("--sleep-blocks", type=int, default=Setting.sleep_blocks)
    parser.add_argument("--smoke", action="store_true", help="a small pool, few cycles")
    args = parser.parse_args()
    measure_and_report(args, measure, "block pool", COLUMNS)


if __name__ == "__main__":
    main()
