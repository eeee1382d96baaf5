"""Where one decode step's time goes: wall, GPU and host milliseconds, kernels and
blocking waits per step, and the memory-bandwidth roofline, on the Qwen3-0.6B shape
(or SmolLM2-135M's: --shape smollm2-135m; Gemma3-1B's: --shape gemma3-1b).

    python benchmarks/bench_step.py [--batch-sizes 1 256] [--shape S] [--prompt-len N]
        [--baseline-src DIR] [--json OUT]
    python benchmarks/bench_step.py --smoke   # tiny model on the CPU: proves it runs

The engine (random bf16 weights of the shape, extensible KV cache, CUDA
graphs) is driven one step at a time through `LLM.engine` (`add_request`, `step`,
`has_unfinished_requests`; `step(finished_only=True)`, as `LLM.generate` steps, where
the tree has it): every batch size with asynchronous scheduling ("async"), batch 1
also without ("sync"). Each batch gets random 512-token prompts (greedy, ignore_eos);
the steps run until every request has its first token (the prefill), then 8 more,
then the figures come from steady decode only (--smoke: fewer steps of everything):

- wall ms: 64 consecutive steps timed end to end, per step (`tok/s` = batch / it).
- host ms: the same steps' wall time less the time spent blocked waiting for the
  device, per step: the time inside `torch.cuda.Event.synchronize`,
  `torch.cuda.Stream.synchronize`, `torch.cuda.synchronize`, and `item`, `tolist`,
  `cpu` of CUDA tensors, all timed while the steps run. It is the host's own work of a
  step (scheduling, inputs, launches, bookkeeping); a wait the engine makes some other
  way counts as host time, which `syncs` would show.
- launch ms: the part of host ms inside the decode graph's launch (`graphs.run`, the
  replay: a few microseconds, unless the device's launch queue is full and the launch
  waits for room, a wait no sync call shows; on the CPU, --smoke, the eager body).
- gpu ms: the durations of the CUDA kernels that torch.profiler records over
  32 more steps (the device idle before and synchronised after them), summed
  and divided by the steps; `kernels` is their count per step, `syncs` the number of
  blocking CUDA runtime calls (names with "Synchronize") per step.
- roof ms: the bytes a step must read (the weights, plus the K and V of every
  sequence at its mean context over the timed steps) over the device's copy bandwidth
  (`_common.device_bandwidth`); `of roof` = roof ms / wall ms.

With --baseline-src the same runs again on an older extkv tree, each tree in a fresh
process, and the tables show both with after/before ratios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from _common import (
    Column,
    Rows,
    benchmark_parser,
    device_bandwidth,
    engine_options,
    gemma3_1b_checkpoint,
    kernel_figures,
    measure_and_report,
    qwen3_0_6b_checkpoint,
    random_prompts,
    smollm2_135m_checkpoint,
    tiny_checkpoint,
    trace_events,
)
from extkv import LLM, SamplingParams

logger = logging.getLogger("bench_step")
COLUMNS: list[Column] = [
    ("wall_ms", "wall ms", ".3f"),
    ("gpu_ms", "gpu ms", ".3f"),
    ("host_ms", "host ms", ".3f"),
    ("launch_ms", "launch ms", ".3f"),
    ("kernels", "kernels", ".1f"),
    ("syncs", "syncs", ".2f"),
    ("roof_ms", "roof ms", ".3f"),
    ("of_roof", "of roof", ".3f"),
    ("tok_s", "tok/s", ".0f"),
]


@dataclass(frozen=True)
class Setting:
    """The shapes of one run: the real one, or --smoke's."""

    prompt_len: int = 512
    warmup: int = 8
    timed: int = 64
    profiled: int = 32


SMOKE = Setting(prompt_len=32, warmup=2, timed=4, profiled=2)


class BlockedTimer:
    """Seconds spent in the calls that wait for the device, while `active()` runs: the
    wrapped methods are swapped in on their classes and put back afterwards."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _timing(self, fn: Callable, cuda_only: bool) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if cuda_only and not args[0].is_cuda:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    @contextlib.contextmanager
    def active(self) -> Iterator[BlockedTimer]:
        targets = [
            (torch.cuda.Event, "synchronize", False),
            (torch.cuda.Stream, "synchronize", False),
            (torch.cuda, "synchronize", False),
            *((torch.Tensor, name, True) for name in ("item", "tolist", "cpu")),
        ]
        missing = object()
        saved = [(owner, name, vars(owner).get(name, missing)) for owner, name, _ in targets]
        for owner, name, cuda_only in targets:
            setattr(owner, name, self._timing(getattr(owner, name), cuda_only))
        try:
            yield self
        finally:
            for owner, name, original in saved:
                if original is missing:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


class GraphTimer:
    """Seconds spent in `graphs.run` (the decode graph's replay, or its eager body off
    CUDA) and its calls, while `active()` runs: a wrapper set on the instance (it
    shadows the class's method) and removed after. With `skip_body` only the first
    call runs the body."""

    def __init__(self, graphs, skip_body: bool = False) -> None:
        self.graphs = graphs
        self.skip_body = skip_body
        self.seconds = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[GraphTimer]:
        run = self.graphs.run

        @functools.wraps(run)
        def timed_run(*args, **kwargs):
            start = time.perf_counter()
            try:
                if not (self.skip_body and self.calls):
                    return run(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        self.graphs.run = timed_run
        try:
            yield self
        finally:
            del self.graphs.run


def stepper(engine) -> Callable[[], object]:
    """One engine step as `LLM.generate` takes it (only finished outputs), where the
    engine's `step` has that option (an older tree may not)."""
    if "finished_only" in inspect.signature(engine.step).parameters:
        return functools.partial(engine.step, finished_only=True)
    return engine.step


def run_prefill(engine, request_ids: set[str], limit: int = 100_000) -> int:
    """Step until every request has had a token out; the number of steps it took."""
    seen: set[str] = set()
    for steps in range(1, limit + 1):
        seen.update(output.request_id for output in engine.step())
        if request_ids <= seen:
            return steps
    raise RuntimeError(f"the prefill of {len(request_ids)} requests took over {limit} steps")


def step_figures(
    llm: LLM, batch: int, vocab: int, setting: Setting, top: int = 0, layers: int = 0
) -> dict[str, float]:
    """The figures of one batch size on `llm` (see the module's docstring); `top` > 0
    logs that many of the kernels that take the most time, `layers` (the model's decoder
    layers) the layer table (`log_layer_table`)."""
    engine = llm.engine
    tokens = setting.warmup + setting.timed + setting.profiled + 8
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = random_prompts(batch, vocab, setting.prompt_len)
    request_ids = {engine.add_request(ids, params) for ids in prompts}
    step = stepper(engine)
    prefill_steps = run_prefill(engine, request_ids)
    for _ in range(setting.warmup):
        step()
    timer, launches = BlockedTimer(), GraphTimer(engine.runner.graphs)
    with timer.active(), launches.active():
        start = time.perf_counter()
        for _ in range(setting.timed):
            step()
        wall = (time.perf_counter() - start) / setting.timed
    figures = {
        "wall_ms": wall * 1e3,
        "host_ms": (wall - timer.seconds / setting.timed) * 1e3,
        "launch_ms": launches.seconds / setting.timed * 1e3,
    }
    events = trace_events(step, setting.profiled)
    figures |= kernel_figures(events, setting.profiled, top)
    cuda = torch.cuda.is_available()
    if layers and cuda and (kernels := last_step_kernels(events, setting.profiled)):
        log_layer_table(kernels, layers)  # from the same steps as the figures above
    while engine.has_unfinished_requests():  # the requests run out in a few more steps
        step()
    logger.info("batch %d: %d prefill steps", batch, prefill_steps)
    figures["tok_s"] = batch / wall
    figures["mean_context"] = setting.prompt_len + 1 + setting.warmup + setting.timed / 2
    return figures


def last_step_kernels(events: list[dict], steps: int) -> list[dict] | None:
    """The kernels (Chrome-trace events, in start order) of the last of `steps` steps'
    `trace_events`, or None if the steps did not launch as many each (steady decode does).
    Steps are counted, not told apart by idle gaps: with asynchronous scheduling there are
    none."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels or len(kernels) % steps:
        logger.info("layer table: %d kernels in %d steps, not as many each", len(kernels), steps)
        return None
    return kernels[-len(kernels) // steps :]


def log_layer_table(kernels: list[dict], num_layers: int) -> None:
    """Log where a decoder layer's time goes: each kernel of a layer with its share of
    the step's critical path, the time from the previous kernel's end to its own (with
    PDL kernels overlap, so their durations do not add up; these do), averaged over the
    layers but the first and last. A layer starts at the step's first GEMV (the decode
    GEMV's batches only: up to 16 rows), or ends at each one-row MLP kernel where those
    run (a kernel only the first layer has counts before the layers)."""
    ends = [k["ts"] + k["dur"] for k in kernels]
    shares = [ends[0] - kernels[0]["ts"], *(b - a for a, b in itertools.pairwise(ends))]
    first = next((i for i, k in enumerate(kernels) if "gemv" in k["name"]), None)
    mlps = [i for i, k in enumerate(kernels) if "_gated_mlp_kernel" in k["name"]]
    if first is None or num_layers < 3:
        logger.info("layer table: none (it needs 3+ layers and the GEMV: batches of <= 16)")
        return
    if len(mlps) >= 2:
        per_layer = mlps[1] - mlps[0]
        first = mlps[0] - per_layer + 1
    else:
        per_layer = (len(kernels) - first) // num_layers  # the layers' kernels, then the tail's
        while per_layer > 1 and kernels[first + per_layer]["name"] != kernels[first]["name"]:
            per_layer -= 1
    inner = range(1, num_layers - 1)
    last = first + num_layers * per_layer
    logger.info(
        "layer table: %d kernels a layer, %.2f us a layer; %.1f us before the first layer, "
        "%.1f us after the last",
        per_layer,
        sum(ends[first + (i + 1) * per_layer - 1] - ends[first + i * per_layer - 1] for i in inner)
        / len(inner),
        (ends[first - 1] if first else kernels[0]["ts"]) - kernels[0]["ts"],
        ends[-1] - ends[last - 1],
    )
    for role in range(per_layer):
        kernel = kernels[first + role]
        share = sum(shares[first + i * per_layer + role] for i in inner) / len(inner)
        grid = kernel.get("args", {}).get("grid")
        logger.info("layer  %6.2f us  grid %-14s %s", share, grid, kernel["name"][:60])
    for kernel, share in zip(kernels[last:], shares[last:], strict=True):
        logger.info(
            "tail   %6.2f us  grid %-14s %s",
            share,
            kernel.get("args", {}).get("grid"),
            kernel["name"][:60],
        )


def weights_bytes(llm: LLM, checkpoint: Path) -> int:
    """The engine's weights, by its memory report; else the checkpoint's safetensors."""
    with contextlib.suppress(Exception):
        return int(llm.memory_report()["weights_bytes"])
    return sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))


SHAPES = {
    "qwen3-0.6b": qwen3_0_6b_checkpoint,
    "smollm2-135m": smollm2_135m_checkpoint,
    "gemma3-1b": gemma3_1b_checkpoint,
}


def checkpoint(args) -> Path:
    return tiny_checkpoint("qwen3") if args.smoke else SHAPES[args.shape]()


def measure(args) -> Rows:
    setting = SMOKE if args.smoke else Setting()
    if args.prompt_len is not None:
        setting = dataclasses.replace(setting, prompt_len=args.prompt_len)
    path = checkpoint(args)
    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bandwidth = math.nan if args.smoke else device_bandwidth()
    batch_sizes = args.batch_sizes or ([1, 4] if args.smoke else [1, 256])
    rows: Rows = {}
    for async_scheduling in (True, False):
        batches = batch_sizes if async_scheduling else [b for b in batch_sizes if b == 1]
        if not batches:
            continue
        llm = LLM(
            str(path),
            enable_extensible_kv_cache=True,
            async_scheduling=async_scheduling,
            max_num_seqs=max(batches),
            max_model_len=setting.prompt_len + setting.warmup + setting.timed + 64,
            **engine_options(args.smoke),
        )
        weights = weights_bytes(llm, path)
        # The engine's default dtype: bfloat16 on CUDA, float32 on the CPU.
        dtype_bytes = 4 if args.smoke else 2
        kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
        kv_per_token *= head_dim * dtype_bytes
        for batch in batches:
            layers = config["num_hidden_layers"] if args.layer_table else 0
            figures = step_figures(
                llm, batch, config["vocab_size"], setting, args.kernel_table, layers
            )
            step_bytes = weights + batch * figures["mean_context"] * kv_per_token
            figures["roof_ms"] = step_bytes / bandwidth * 1e3
            figures["of_roof"] = figures["roof_ms"] / figures["wall_ms"]
            figures["bandwidth_gb_s"] = bandwidth / 1e9
            rows[f"b{batch} {'async' if async_scheduling else 'sync'}"] = figures
        llm.close()
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 256 (smoke: 1 4)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few steps")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="random weights of this model"
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        help="prompt tokens per sequence (default 512, smoke 32): e.g. 128 for bench_smollm2's",
    )
    parser.add_argument(
        "--kernel-table", type=int, default=0, help="log the N costliest kernels (default 0: none)"
    )
    parser.add_argument(
        "--layer-table",
        action="store_true",
        help="log each decoder-layer kernel's share of a step's critical path (CUDA only)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    checkpoint(args)  # here, before any child: built by this tree's extkv.demo
    measure_and_report(args, measure, "step", COLUMNS)


if __name__ == "__main__":
    main()
