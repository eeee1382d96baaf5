"""The engine's host (Python) time per decode step on the CPU, without the model's compute:
scheduling, building the step's inputs, sampling bookkeeping, reading the tokens, outputs.

    python benchmarks/bench_host.py [--batch-sizes 1 64 256] [--prompt-len 16]
        [--skip-graph-body] [--baseline-src DIR] [--json OUT]
    python benchmarks/bench_host.py --smoke   # fewer, smaller batches: proves it runs

A random 1-layer checkpoint (demo size, vocabulary 384) runs on the CPU in one engine
(asynchronous scheduling, the default on one rank), driven one step at a time through
`LLM.engine` as `LLM.generate` drives it (`step(finished_only=True)`, where the tree has
it). Each batch gets random prompts of `--prompt-len` tokens (16; SmolLM2's benchmark
has 128: longer block tables) (greedy, ignore_eos, enough tokens that none
finishes while timed); the steps run until every request has its first token (the
prefill), then some warm-up decode steps, then `--repeats` windows of `--steps` decode
steps each are timed.

- host us: a window's wall time less the time spent in the decode graph's body, per
  step: `runner.graphs.run`, which on a GPU replays the captured graph (the model's
  forward, its logits and their greedy argmax: one call, a few microseconds of host
  time) and here runs the same body eagerly; it is wrapped on the instance while the
  window runs. The best (lowest) window counts, as `timeit` takes the best of its
  repeats, since other processes on the machine only ever add time. What is left is
  the engine's own work per step: `Scheduler.schedule`/`launched`/`update`,
  `build_step_inputs` and staging the inputs, `SamplingBatch.build` and the sampler,
  reading the tokens, the engine's bookkeeping and outputs. On a GPU the same work
  also launches a few kernels (the inputs' copy, the sampled tokens' copies); here
  those few torch ops run on the CPU, over at most 256 rows. The graph's body, run on
  the CPU, leaves its caches cold for the host work after it, so the figures are above
  what the same work costs beside a GPU (bench_step's host ms): compare trees with
  --baseline-src rather than these figures with that.
- us/req: host us over the batch size: the per-request part of it at large batches.
- graph us: the time inside the graph's body per step (what was taken out), for reference.

With --skip-graph-body the body runs only in a window's first step; the later ones
reuse its logits and tokens (they are the persistent outputs the body wrote), so the
host work runs with warm caches, closer to what it costs beside a GPU, and with less
noise from the body's compute; the tokens then repeat, which the host work does not
look at (greedy, ignore_eos).

With --baseline-src the same runs again on an older extkv tree, each tree in a fresh
process, and the tables show both with after/before ratios.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from _common import Column, Rows, benchmark_parser, measure_and_report, random_checkpoint
from bench_step import GraphTimer, run_prefill, stepper
from extkv import LLM, SamplingParams

logger = logging.getLogger("bench_host")
COLUMNS: list[Column] = [
    ("host_us", "host us", ".1f"),
    ("us_per_request", "us/req", ".2f"),
    ("graph_us", "graph us", ".1f"),
]


@dataclass(frozen=True)
class Setting:
    """The shapes of one run: the real one, or --smoke's."""

    batch_sizes: tuple[int, ...] = (1, 64, 256)
    warmup: int = 8
    steps: int = 32
    repeats: int = 5


SMOKE = Setting(batch_sizes=(1, 4), warmup=2, steps=4, repeats=2)


def checkpoint():
    """A random 1-layer checkpoint of the demo's size: the model's compute stays small."""
    return random_checkpoint("/tmp/extkv-bench/host-1layer", "qwen3", num_hidden_layers=1)


def host_figures(llm: LLM, batch: int, vocab: int, setting: Setting, args) -> dict[str, float]:
    """The figures of one batch size on `llm` (see the module's docstring)."""
    engine = llm.engine
    tokens = setting.warmup + setting.steps * setting.repeats + 8
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [
        [1 + (i * 7 + j) % (vocab - 1) for j in range(args.prompt_len)] for i in range(batch)
    ]
    request_ids = {engine.add_request(ids, params) for ids in prompts}
    step = stepper(engine)
    run_prefill(engine, request_ids)
    for _ in range(setting.warmup):
        step()
    windows = []
    for _ in range(setting.repeats):
        timer = GraphTimer(engine.runner.graphs, args.skip_graph_body)
        with timer.active():
            start = time.perf_counter()
            for _ in range(setting.steps):
                step()
            wall = time.perf_counter() - start
        if timer.calls != setting.steps:
            raise RuntimeError(
                f"batch {batch}: {timer.calls} of {setting.steps} steps ran the decode graph; "
                "every timed step must be a decode within the graphs' batch sizes"
            )
        windows.append((wall - timer.seconds, timer.seconds))
    while engine.has_unfinished_requests():  # the requests run out in a few more steps
        step()
    host, graph = min(windows)
    host_us = host / setting.steps * 1e6
    return {
        "host_us": host_us,
        "us_per_request": host_us / batch,
        "graph_us": graph / setting.steps * 1e6,
    }


def measure(args) -> Rows:
    setting = SMOKE if args.smoke else Setting()
    batch_sizes = args.batch_sizes or setting.batch_sizes
    llm = LLM(
        str(checkpoint()),
        device="cpu",
        cpu_memory_budget_bytes=256 << 20,
        max_num_seqs=max(batch_sizes),
        max_model_len=args.prompt_len + setting.warmup + setting.steps * setting.repeats + 64,
    )
    vocab = llm.engine.vocab_size
    rows: Rows = {
        f"b{batch}": host_figures(llm, batch, vocab, setting, args) for batch in batch_sizes
    }
    llm.close()
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 64 256 (smoke: 1 4)")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens of each prompt")
    parser.add_argument(
        "--skip-graph-body", action="store_true", help="run the body once a window (see above)"
    )
    parser.add_argument("--smoke", action="store_true", help="small batches, few steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    checkpoint()  # here, before any child: built by this tree's extkv.demo
    measure_and_report(args, measure, "host time per decode step", COLUMNS)


if __name__ == "__main__":
    main()
