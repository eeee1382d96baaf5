"""Start-up and KV capacity: legacy vs extensible on the Qwen3-0.6B shape, one run.

    python benchmarks/bench_startup.py [--max-num-seqs 256] [--max-model-len 2048] [--json OUT]

Each path starts in a fresh process (so neither inherits the other's memory),
reports its memory, then runs a max-load step: `max_num_seqs` long prompts at
once, then decodes them together. We record the GPU memory left free after it
and the activation peak of the real steps against the profiled one (what the
extensible margin has to cover).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time

import torch

from _common import qwen3_0_6b_checkpoint, write_json

GiB = 1 << 30


def child(
    path: str, extensible: bool, max_num_seqs: int, max_model_len: int, skip_load: bool
) -> dict:
    from extkv import LLM, SamplingParams

    llm = LLM(
        path,
        enable_extensible_kv_cache=extensible,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    report = llm.memory_report()
    if skip_load:
        return report
    tokens_each = min(
        max_model_len - 8, report["num_blocks"] * report["block_size"] // max_num_seqs - 8
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 1000, (max_num_seqs, tokens_each), generator=gen).tolist()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    torch.cuda.synchronize()
    report["max_load_tokens"] = max_num_seqs * (tokens_each + 8)
    report["max_load_activation_peak_bytes"] = torch.cuda.max_memory_allocated() - before
    report["free_after_max_load_bytes"] = torch.cuda.mem_get_info()[0]
    report["total_bytes"] = torch.cuda.mem_get_info()[1]
    return report


def wait_for_free_memory(timeout: float = 30.0) -> None:
    """Start each child only once the last one's memory is back with the driver."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free > 0.97 * total:
            return
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--json")
    parser.add_argument("--child", choices=["legacy", "extensible"], help=argparse.SUPPRESS)
    parser.add_argument("--skip-load", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = str(qwen3_0_6b_checkpoint())
    if args.child:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        result = child(
            path, args.child == "extensible", args.max_num_seqs, args.max_model_len, args.skip_load
        )
        print("RESULT " + json.dumps(result, default=str))
        return
    # Fresh processes in the order E, L, L, E: each path once right after the other,
    # once after itself. Startup is the best of its two; the rest from its last run.
    reports: dict[str, dict] = {}
    for i, name in enumerate(("extensible", "legacy", "legacy", "extensible")):
        wait_for_free_memory()
        cmd = [sys.executable, __file__, "--child", name, *(["--skip-load"] if i < 2 else [])]
        cmd += [
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-model-len",
            str(args.max_model_len),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        sys.stderr.write(proc.stderr[-3000:])
        if proc.returncode:
            raise SystemExit(f"{name} failed with exit code {proc.returncode}")
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        report = json.loads(line.removeprefix("RESULT "))
        if name in reports:
            report["startup_seconds"] = min(
                report["startup_seconds"], reports[name]["startup_seconds"]
            )
        reports[name] = report
    ext = reports["extensible"]
    target = ext["available_bytes"] - ext["graph_pool_bytes"] - ext["margin_bytes"]
    print(f"{'':32} {'legacy':>12} {'extensible':>12}")
    rows = [
        ("KV blocks", "num_blocks", 1),
        ("KV GiB", "kv_cache_bytes", GiB),
        ("graph pool GiB (actual)", "graph_pool_bytes", GiB),
        ("graph pool GiB (estimate)", "graph_pool_estimate_bytes", GiB),
        ("activation peak GiB (profiled)", "activation_peak_bytes", GiB),
        ("activation peak GiB (max load)", "max_load_activation_peak_bytes", GiB),
        ("free GiB after max-load step", "free_after_max_load_bytes", GiB),
        ("startup s", "startup_seconds", 1),
        ("  load weights s", "load_seconds", 1),
        ("  profile s", "profile_seconds", 1),
        ("  KV setup s", "kv_setup_seconds", 1),
        ("    capture s", "capture_seconds", 1),
        ("    extend s", "extend_seconds", 1),
    ]
    for label, key, scale in rows:
        cells = []
        for name in ("legacy", "extensible"):
            value = reports[name].get(key)
            cells.append("-" if value is None else f"{value / scale:.3f}")
        print(f"{label:32} {cells[0]:>12} {cells[1]:>12}")
    print(
        f"extensible KV / (available - graph pool - margin) = {ext['kv_cache_bytes'] / target:.4f}"
    )
    print(
        f"extensible / legacy KV blocks = {ext['num_blocks'] / reports['legacy']['num_blocks']:.3f}"
    )
    print(
        "extensible / legacy startup = "
        f"{ext['startup_seconds'] / reports['legacy']['startup_seconds']:.3f}"
    )
    write_json(args.json, reports)


if __name__ == "__main__":
    main()
