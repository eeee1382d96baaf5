"""Pieces the benchmarks share: the 0.6B-shaped model, bandwidth, timing, and the
before/after mechanism (one measurement per extkv source tree, side by side)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def random_checkpoint(
    folder: str, architecture: str, shape: str | dict[str, object] | None = None, **options
) -> Path:
    """A random checkpoint (no tokenizer) of `architecture` in `folder`, built once: bf16
    in `shape` (the config overrides, or the name of one of extkv.demo's shapes), or
    demo-sized in fp32 without one; `options` (config fields, `device`) go to
    make_random_checkpoint too. Built by the parent of a --baseline-src run: extkv.demo is
    this tree's, which an older one may lack."""
    path = Path(folder)
    if not (path / "config.json").exists():
        from extkv import demo

        if shape is not None:
            overrides = getattr(demo, shape) if isinstance(shape, str) else shape
            options = {"dtype": torch.bfloat16, **overrides, **options}
            logger.info("building a random bf16 %s checkpoint in %s", architecture, path)
        demo.make_random_checkpoint(path, architecture, with_tokenizer=False, **options)
        if torch.cuda.is_available():  # built on the GPU: its memory is no engine's budget
            torch.cuda.empty_cache()
    return path


def qwen3_0_6b_checkpoint(folder: str = "/tmp/extkv-bench/qwen3-0.6b") -> Path:
    """A random bf16 checkpoint of Qwen3-0.6B's shape."""
    return random_checkpoint(folder, "qwen3", "QWEN3_0_6B_SHAPE")


SMOLLM2_135M_SHAPE = dict(  # SmolLM2-135M's config (a Llama), for random-weight timing
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    initializer_range=0.02,
)


def smollm2_135m_checkpoint(folder: str = "/tmp/extkv-bench/smollm2-135m-random") -> Path:
    """A random bf16 checkpoint of SmolLM2-135M's shape (tied embeddings): the real model's
    step costs without needing its weights."""
    return random_checkpoint(folder, "llama", SMOLLM2_135M_SHAPE)


# Gemma3-1B's text config: every sixth layer global.
GEMMA3_1B_SHAPE = dict(
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    initializer_range=0.02,
)


def gemma3_1b_checkpoint(folder: str = "/tmp/extkv-bench/gemma3-1b") -> Path:
    """A random bf16 checkpoint of Gemma3-1B's text shape (5 sliding : 1 global layers)."""
    return random_checkpoint(folder, "gemma3", GEMMA3_1B_SHAPE)


def tiny_checkpoint(architecture: str = "qwen3") -> Path:
    """A tiny random checkpoint (demo size) for the benchmarks' --smoke runs on the CPU."""
    return random_checkpoint(f"/tmp/extkv-bench/tiny-{architecture}", architecture)


def engine_options(smoke: bool) -> dict[str, object]:
    """LLM options of a benchmark's engine: on the CPU for --smoke, else a moderate share
    of the GPU (a benchmark's engines run one after the other, never beside another)."""
    if smoke:
        return {"device": "cpu", "cpu_memory_budget_bytes": 256 << 20}
    return {"gpu_memory_utilization": 0.4}


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


def synchronize() -> None:
    """Wait for the GPU, where there is one (the benchmarks' smoke settings run on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, object]:
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return time.perf_counter() - start, result


def random_prompts(batch: int, vocab: int, length: int, seed: int | None = None) -> list[list[int]]:
    """`batch` prompts of `length` token ids in [1, vocab), seeded by `seed` (default: `batch`)."""
    gen = torch.Generator().manual_seed(batch if seed is None else seed)
    return torch.randint(1, vocab, (batch, length), generator=gen).tolist()


def profile_kernels(fn: Callable[[], object], calls: int, top: int = 0) -> dict[str, float]:
    """`kernel_figures` of `calls` calls of `fn` (`trace_events`)."""
    return kernel_figures(trace_events(fn, calls), calls, top)


def trace_events(fn: Callable[[], object], calls: int) -> list[dict]:
    """The events torch.profiler records over `calls` calls of `fn` (the device idle before
    and synchronised after them, by a call not counted), read from its Chrome-trace export,
    whose keys every torch version shares."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize()
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(calls):
            fn()
        synchronize()
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        return json.loads(trace.read_text()).get("traceEvents", [])


def kernel_figures(events: list[dict], calls: int, top: int = 0) -> dict[str, float]:
    """GPU ms (kernel durations summed), kernels and blocking CUDA runtime calls per call,
    from the `trace_events` of `calls` calls. NaN on the CPU. `top` > 0 logs the kernels
    that took the most time (us per call, launches per call), to see where it goes."""
    cuda = torch.cuda.is_available()
    if not cuda:
        return {"gpu_ms": math.nan, "kernels": math.nan, "syncs": math.nan}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    syncs = [
        e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Synchronize" in e.get("name", "")
    ][1:]  # the closing synchronize() is ours
    if not kernels:
        logger.warning("the profiler recorded no kernel; gpu ms is not known")
        return {"gpu_ms": math.nan, "kernels": math.nan, "syncs": len(syncs) / calls}
    if top:
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.get("name", "?"), []).append(e.get("dur", 0.0))
        ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
        for name, durations in ranked:
            logger.info(
                "kernel %8.1f us %5.1fx  %s",
                sum(durations) / calls,
                len(durations) / calls,
                name[:110],
            )
    return {
        "gpu_ms": sum(e.get("dur", 0.0) for e in kernels) / 1e3 / calls,
        "kernels": len(kernels) / calls,
        "syncs": len(syncs) / calls,
    }


def _throughput(run, batch: int, output_len: int) -> tuple[float, float]:
    """(end-to-end output tokens/s, decode-only tokens/s): a full run against a
    one-token run of the same prompts, so the prefill drops out of the second."""
    run(2)  # warm-up
    t_one, _ = timed(lambda: run(1))
    t_all, _ = timed(lambda: run(output_len))
    return batch * output_len / t_all, batch * (output_len - 1) / (t_all - t_one)


@dataclass(frozen=True)
class DecodeSetting:
    """The shapes of a decode-throughput run: the real one, or --smoke's (SMOKE_DECODE)."""

    prompt_len: int = 256
    output_len: int = 128
    batch_sizes: tuple[int, ...] = (1, 64)


SMOKE_DECODE = DecodeSetting(prompt_len=16, output_len=4, batch_sizes=(1, 2))


def decode_throughput(llm, batch: int, vocab: int, prompt_len: int, output_len: int):
    from extkv import SamplingParams

    ids = random_prompts(batch, vocab, prompt_len)

    def run(n: int):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)

    return _throughput(run, batch, output_len)


def hf_decode_throughput(model, batch: int, vocab: int, prompt_len: int, output_len: int):
    ids = torch.tensor(random_prompts(batch, vocab, prompt_len), device=model.device)
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


# --- before/after: one measurement per source tree, side by side ---------------------

Rows = dict[str, dict[str, float | str]]  # case -> column -> figure (or text)
Column = tuple[str, str, str]  # key, heading, format spec


def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the options of `measure_trees` (no abbreviations: the
    child's command line is the parent's with two of them taken out)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="an older extkv src/ tree: measure it too, each tree in a process of its own, "
        "and print both side by side with after/before ratios",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def _child_argv(argv: list[str]) -> list[str]:
    """`argv` without --baseline-src and --json (and their values)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--baseline-src", "--json"):
            skip = True
        elif not arg.startswith(("--baseline-src=", "--json=")):
            kept.append(arg)
    return kept


def env_with_src(src: Path | None) -> dict[str, str]:
    """This process's environment with `src` (an extkv src/ tree) first on PYTHONPATH, so a
    child imports that extkv; None: unchanged."""
    env = dict(os.environ)
    if src is not None:
        path = str(Path(src).resolve())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    return env


def _run_child(src: Path | None) -> dict:
    """This script once more, as --child, with `src` first on PYTHONPATH (None: as this
    process has it); its figures come back through a JSON file."""
    env = env_with_src(src)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "figures.json"
        command = [sys.executable, os.path.abspath(sys.argv[0]), *_child_argv(sys.argv[1:])]
        command += ["--child", "--json", str(out)]
        logger.info("measuring %s in a child process", src or "this tree")
        code = subprocess.run(command, env=env).returncode
        if code != 0:
            raise SystemExit(f"the child measuring {src or 'this tree'} failed (exit {code})")
        return json.loads(out.read_text())


def _measured(measure: Callable[[argparse.Namespace], Rows], args: argparse.Namespace) -> dict:
    import extkv

    return {"extkv": str(Path(extkv.__file__).parent), "rows": measure(args)}


def measure_trees(
    args: argparse.Namespace, measure: Callable[[argparse.Namespace], Rows]
) -> dict[str, dict] | None:
    """{"after": this tree's figures} and with --baseline-src also {"before": ...} of that
    tree; each {"extkv": package folder, "rows": Rows}. With --baseline-src both run in
    fresh processes, the baseline first, one after the other: neither finds the other's
    memory on the device, and each imports its own extkv. As --child: measure, write
    --json, return None (the parent prints)."""
    if args.child:
        Path(args.json).write_text(json.dumps(_measured(measure, args)))
        return None
    if args.baseline_src is None:
        return {"after": _measured(measure, args)}
    if not (args.baseline_src / "extkv" / "__init__.py").is_file():
        raise SystemExit(f"--baseline-src {args.baseline_src} holds no extkv package")
    return {"before": _run_child(args.baseline_src), "after": _run_child(None)}


def _cell(value: object, spec: str, width: int) -> str:
    if not isinstance(value, int | float) or math.isnan(value):
        return f"{'-':>{width}}"
    return f"{value:>{width}{spec}}"


def print_table(title: str, rows: Rows, columns: list[Column]) -> None:
    """`rows` under `title`, one line per case that has a figure of `columns`; a figure
    a row lacks (or NaN) shows '-'."""
    rows = {case: row for case, row in rows.items() if any(k in row for k, _, _ in columns)}
    first = max([len("case"), *map(len, rows)])
    cells = [(key, heading, spec, max(len(heading), 8)) for key, heading, spec in columns]
    print(f"== {title}")
    print(f"{'case':<{first}}", *(f"{heading:>{w}}" for _, heading, _, w in cells))
    for case, row in rows.items():
        print(f"{case:<{first}}", *(_cell(row.get(k), spec, w) for k, _, spec, w in cells))


def ratios(after: Rows, before: Rows) -> Rows:
    """after / before of every figure that both have (and that is not 0 before)."""
    out: Rows = {}
    for case, row in after.items():
        old = before.get(case, {})
        out[case] = {
            k: v / old[k]
            for k, v in row.items()
            if isinstance(old.get(k), int | float) and old[k] and isinstance(v, int | float)
        }
    return out


def report(name: str, results: dict[str, dict], columns: list[Column]) -> None:
    """The tables of `measure_trees`' results: this tree's, then the baseline's and the
    after/before ratios; each title names the extkv package that was measured."""
    after = results["after"]
    print_table(f"{name}: after ({after['extkv']})", after["rows"], columns)
    if "before" in results:
        before = results["before"]
        print_table(f"{name}: before ({before['extkv']})", before["rows"], columns)
        ratio_columns = [(k, h, ".3f") for k, h, _ in columns]
        print_table(f"{name}: after/before", ratios(after["rows"], before["rows"]), ratio_columns)
    print_texts(name, results)


def print_texts(name: str, results: dict[str, dict]) -> None:
    """The text figures of the rows (e.g. a completion), once where both trees agree."""
    before = results.get("before", {}).get("rows", {})
    lines = []
    for case, row in results["after"]["rows"].items():
        for key, text in row.items():
            if not isinstance(text, str):
                continue
            old = before.get(case, {}).get(key)
            if old is None or old == text:
                same = " (the same before)" if old is not None else ""
                lines.append(f"{case} {key}{same}: {text!r}")
            else:
                lines += [f"{case} {key} after: {text!r}", f"{case} {key} before: {old!r}"]
    if lines:
        print(f"== {name}: text")
        print("\n".join(lines))


def write_json(path: str | Path | None, results: object) -> None:
    """`results` as JSON into `path` (a --json option's value), where one is given."""
    if path is not None:
        Path(path).write_text(json.dumps(results, indent=1, default=str))


def measure_and_report(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace], Rows],
    name: str,
    columns: list[Column],
    add: Callable[[Rows], None] | None = None,
) -> None:
    """A benchmark's `main` after its parser: `measure_trees`, then (not as --child) `add`
    figures to this tree's rows in this process, print the tables and write --json."""
    results = measure_trees(args, measure)
    if results is None:
        return
    if add is not None:
        add(results["after"]["rows"])
    report(name, results, columns)
    write_json(args.json, results)
