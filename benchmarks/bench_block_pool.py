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
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from _common import Column, Rows, benchmark_parser, measure_and_report
from extkv import SamplingParams
from extkv.engine.block_manager import BlockManager
from extkv.engine.sequence import Sequence
from extkv.kv_cache import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

COLUMNS: list[Column] = [("us_per_block", "us/block", ".3f")]
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Setting:
    num_blocks: int = 872_038
    blocks_per_seq: int = 8
    window: int = 2_000  # cycles timed per row
    afters: tuple[int, ...] = (0, 100_000, 400_000)  # blocks taken before a row's window


SMOKE = Setting(num_blocks=4_096, window=100, afters=(0, 4_000))


def _groups() -> list[KVCacheGroup]:
    """One full-attention and one 512-token sliding-window group (Gemma 3's two kinds)."""
    full = FullAttentionSpec(BLOCK_SIZE, 1, 256, torch.bfloat16)
    local = SlidingWindowSpec(BLOCK_SIZE, 1, 256, torch.bfloat16, 512)
    return [KVCacheGroup(["global"], full), KVCacheGroup(["local"], local)]


def measure(args) -> Rows:
    setting = SMOKE if args.smoke else Setting(num_blocks=args.num_blocks)
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
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--num-blocks", type=int, default=Setting.num_blocks)
    parser.add_argument("--smoke", action="store_true", help="a small pool, few cycles")
    args = parser.parse_args()
    measure_and_report(args, measure, "block pool", COLUMNS)


if __name__ == "__main__":
    main()
