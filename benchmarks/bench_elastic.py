"""Elastic memory on the device: sleep and wake, KV cache resizes, two engines on one GPU.

    python benchmarks/bench_elastic.py [--weights-gib 4] [--kv-gib 16] [--json OUT]
    python benchmarks/bench_elastic.py --smoke   # CPU, host backend, tiny model: proves it runs

Sections, each a table:
- `mechanism`: the same tensors (W GiB of weights as 64 parameters, K GiB of KV cache)
  put to sleep and woken by extkv (the engine's own classes: WeightMemory for the
  weights, an ExtensibleTensor for the KV cache) and by torch_memory_saver (its
  in-process "torch" hook mode, weights with its CPU backup), side by side in one
  process. Level 1 saves the weights to host memory; level 2 (and the KV cache at any
  level) drops the bytes. extkv's KV wake also zeroes the cache (the engine needs it);
  torch_memory_saver's leaves it uninitialised. Seconds and GiB/s each way. Beside
  them, the ways a level-1 sleep could keep the weights on the host (`host copy:`
  rows): pinned ahead (WeightMemory pins at start-up), pinned at sleep, pageable.
- `engine`: a Qwen3-0.6B-shaped engine (`enable_sleep_mode=True`, the default 0.9 of
  the device) put to sleep at level 1 and 2 and woken, the same greedy tokens after
  each (level 2 re-reads the checkpoint from disk); vLLM's sleep mode on Qwen3-0.6B
  (A100) is the published anchor: level-1 sleep 0.09-0.10 s, wake 0.25-0.28 s, level-2
  wake 0.78-0.91 s. The KV cache's release costs per byte, and 0.9 of an 80 GB A100
  holds about half the KV cache 0.9 of the H200 does: the `engine 0.5` rows run the
  same at 0.5 of the H200 (`--engine-utilization`), about the anchor's size.
- `resize`: the same engine's KV cache shrunk and grown by 1, 8 and 32 GiB, idle.
- `during`: 64 requests decoding while the cache shrinks by 8 GiB and grows back: the
  median step time, the steps that carried a resize, and whether the tokens are those
  of a run without resizes.
- `shared`: two engines (two processes, the elastic KV policy, each allowed 0.6 of the
  device, so both cannot be at their ceiling at once) under alternating load: one
  works while the other idles and gives its blocks back; tokens/s of each phase, the
  blocks each reached and the device's peak memory in use.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from _common import (
    print_table,
    qwen3_0_6b_checkpoint,
    random_prompts,
    tiny_checkpoint,
    write_json,
)
from extkv import LLM, ExtensibleTensor, SamplingParams
from extkv.engine.weight_memory import WeightMemory

logger = logging.getLogger("bench_elastic")
GiB = 1 << 30
Rows = dict[str, dict[str, object]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _row(gib: float, sleep_s: float, wake_s: float) -> dict[str, float]:
    return {
        "GiB": gib,
        "sleep_s": sleep_s,
        "wake_s": wake_s,
        "sleep_GiB_s": gib / sleep_s,
        "wake_GiB_s": gib / wake_s,
    }


def _weights(total_bytes: int, device: torch.device) -> nn.ParameterList:
    """`total_bytes` of bf16 parameters in 64 tensors, as a model's weights would be."""
    per = total_bytes // 64 // 2
    return nn.ParameterList(
        nn.Parameter(torch.full((per,), float(i % 7), dtype=torch.bfloat16, device=device))
        for i in range(64)
    )


def _checksum(params: nn.ParameterList) -> float:
    return sum(float(p.detach().float().sum()) for p in params)


# --- mechanism: the same tensors, extkv and torch_memory_saver ------------------------


# (level, cycle): on CUDA the host buffer of level 1 is pinned when WeightMemory is
# built (not timed here), so the first sleep should cost what a later one does.
CYCLES = ((1, 1), (1, 2), (2, 1))


def extkv_mechanism(weights_bytes: int, kv_bytes: int, device: torch.device) -> Rows:
    rows: Rows = {}
    model = _weights(weights_bytes, device)
    memory = WeightMemory(model, device)
    before = _checksum(model)
    for level, cycle in CYCLES:
        keep = level == 1
        sleep_s = _timed(lambda k=keep: memory.offload(keep_parameters=k), device)
        wake_s = _timed(memory.restore, device)  # level 2: the parameters left to fill
        rows[f"extkv weights L{level} #{cycle}"] = _row(weights_bytes / GiB, sleep_s, wake_s)
        if keep:
            assert _checksum(model) == before, "level-1 wake changed the weights"
    memory.free()
    del model
    kv = ExtensibleTensor(kv_bytes, device)
    kv.resize_per_segment_(kv_bytes, zero_new=True)
    for zero in (True, False):
        sleep_s = _timed(lambda: kv.shrink_per_segment_(0), device)
        wake_s = _timed(lambda z=zero: kv.resize_per_segment_(kv_bytes, zero_new=z), device)
        name = "extkv kv (zeroed)" if zero else "extkv kv"
        rows[name] = _row(kv_bytes / GiB, sleep_s, wake_s)
    kv.free()
    return rows


def host_copy_ways(num_bytes: int, device: torch.device) -> Rows:
    """Where a level-1 sleep can put the weights, timed on one region (CUDA): a host
    buffer pinned beforehand (what WeightMemory does, at start-up), one pinned at sleep
    (cudaHostRegister of a fresh buffer, then the copy), and plain pageable memory, fresh
    and reused; `sleep_s` is the device-to-host copy with whatever it needs first,
    `wake_s` the copy back."""
    region = torch.randn(num_bytes // 2, dtype=torch.bfloat16, device=device).view(torch.uint8)
    cudart = torch.cuda.cudart()

    def pinned() -> torch.Tensor:
        host = torch.empty(num_bytes, dtype=torch.uint8)
        assert int(cudart.cudaHostRegister(host.data_ptr(), num_bytes, 0)) == 0
        return host

    rows: Rows = {}
    ahead = pinned()
    reused = torch.empty(num_bytes, dtype=torch.uint8)
    reused.fill_(0)  # its pages touched once, as a buffer kept from an earlier sleep's
    ways = {
        "host copy: pinned ahead": lambda: ahead,
        "host copy: pinned at sleep": pinned,
        "host copy: pageable, fresh": lambda: torch.empty(num_bytes, dtype=torch.uint8),
        "host copy: pageable, reused": lambda: reused,
    }
    for name, host_of in ways.items():
        hosts: list[torch.Tensor] = []
        sleep_s = _timed(lambda h=host_of, out=hosts: out.append(h().copy_(region)), device)
        wake_s = _timed(lambda host=hosts[0]: region.copy_(host), device)
        rows[name] = _row(num_bytes / GiB, sleep_s, wake_s)
        if name == "host copy: pinned at sleep":
            cudart.cudaHostUnregister(hosts[0].data_ptr())
    cudart.cudaHostUnregister(ahead.data_ptr())
    return rows


def tms_in_child(args: argparse.Namespace) -> Rows:
    """`tms_mechanism` in a process of its own: torch_memory_saver aborts at interpreter
    exit once its pools were used (its free hook runs outside a region), which would
    fail the benchmark after its figures."""
    command = [sys.executable, __file__, "--tms-child"]
    command += ["--weights-gib", str(args.weights_gib), "--kv-gib", str(args.kv_gib)]
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=600).stdout
    lines = [line[4:] for line in out.splitlines() if line.startswith("TMS ")]
    return json.loads(lines[-1]) if lines else {}


def tms_mechanism(weights_bytes: int, kv_bytes: int, device: torch.device) -> Rows:
    """The same with torch_memory_saver; no rows where it is not installed or cannot run."""
    try:
        from torch_memory_saver import torch_memory_saver as tms

        tms.hook_mode = "torch"
        with tms.region(tag="weights", enable_cpu_backup=True):
            model = _weights(weights_bytes, device)
        with tms.region(tag="dropped"):
            dropped = _weights(weights_bytes, device)
        with tms.region(tag="kv"):
            kv = torch.zeros(kv_bytes, dtype=torch.uint8, device=device)
    except Exception as e:  # absent, or its CUDA runtime does not load here
        logger.warning("torch_memory_saver not measured: %s", e)
        return {}
    rows: Rows = {}
    before = _checksum(model)
    for name, tag, gib in (
        ("tms weights L1 #1", "weights", weights_bytes / GiB),
        ("tms weights L1 #2", "weights", weights_bytes / GiB),
        ("tms weights L2 #1", "dropped", weights_bytes / GiB),
        ("tms kv", "kv", kv_bytes / GiB),
    ):
        sleep_s = _timed(lambda t=tag: tms.pause(t), device)
        wake_s = _timed(lambda t=tag: tms.resume(t), device)
        rows[name] = _row(gib, sleep_s, wake_s)
    assert _checksum(model) == before, "torch_memory_saver's resume changed the weights"
    del model, dropped, kv
    return rows


# --- the engine: sleep and wake, resizes, resizes while decoding ----------------------


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def engine_sleep(llm: LLM, device: torch.device, vocab: int, label: str) -> Rows:
    prompts = random_prompts(4, vocab, 64)
    expected = _greedy(llm, prompts, 16)
    rows: Rows = {}
    for level, cycle in ((1, 1), (1, 2), (2, 1), (2, 2)):
        free_before = _free_bytes(device)
        sleep_s = _timed(lambda lv=level: llm.sleep(level=lv), device)
        freed = _free_bytes(device) - free_before
        wake_s = _timed(llm.wake_up, device)
        rows[f"{label} L{level} #{cycle}"] = {
            **_row(freed / GiB, sleep_s, wake_s),
            "same_tokens": _greedy(llm, prompts, 16) == expected,
        }
    return rows


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 0


def engine_resizes(llm: LLM, device: torch.device, sizes_gib: list[float]) -> Rows:
    rows: Rows = {}
    full = llm.kv_cache_status()["committed_bytes"]
    for gib in sizes_gib:
        target = full - int(gib * GiB)
        if target < llm.kv_cache_status()["min_blocks"] * llm.kv_cache_status()["bytes_per_block"]:
            continue
        down = llm.resize_kv_cache(memory_bytes=target)
        up = llm.resize_kv_cache(memory_bytes=full)
        shrunk = (down["previous_committed_bytes"] - down["committed_bytes"]) / GiB
        grown = (up["committed_bytes"] - up["previous_committed_bytes"]) / GiB
        rows[f"resize {gib:g} GiB"] = {
            "GiB": shrunk,
            "shrink_s": down["seconds"],
            "grow_s": up["seconds"],
            "shrink_GiB_s": shrunk / down["seconds"],
            "grow_GiB_s": grown / up["seconds"],
        }
    return rows


def decode_during_resize(llm: LLM, vocab: int, batch: int, resize_gib: float) -> Rows:
    """Step times of `batch` decoding requests, the cache shrunk by `resize_gib` between
    two steps and grown back later; their tokens against a run without resizes."""
    engine = llm.engine
    prompts = random_prompts(batch, vocab, 512)
    params = SamplingParams(temperature=0.0, max_tokens=192, ignore_eos=True)
    full = llm.kv_cache_status()["committed_bytes"]
    tokens: dict[str, list[list[int]]] = {}
    figures: dict[str, float] = {}
    for resized in (False, True):
        ids = [engine.add_request(p, params) for p in prompts]
        outputs: dict[str, list[int]] = {}
        step_s: list[float] = []
        resizes: list[tuple[str, float, dict]] = []
        step = 0
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            if resized and step == 64:
                resizes.append(
                    (
                        "shrink",
                        start,
                        llm.resize_kv_cache(memory_bytes=full - int(resize_gib * GiB)),
                    )
                )
            if resized and step == 128:
                resizes.append(("grow", start, llm.resize_kv_cache(memory_bytes=full)))
            for out in engine.step(finished_only=True):
                outputs[out.request_id] = out.outputs[0].token_ids
            step_s.append(time.perf_counter() - start)
            step += 1
        tokens[str(resized)] = [outputs[i] for i in ids]
        if resized:
            plain = sorted(s for i, s in enumerate(step_s) if i not in (64, 128))
            figures = {
                "median_step_ms": 1e3 * statistics.median(plain[: len(plain) * 9 // 10]),
                "shrink_step_ms": 1e3 * step_s[64],
                "grow_step_ms": 1e3 * step_s[128],
                "shrink_ms": 1e3 * resizes[0][2]["seconds"],
                "grow_ms": 1e3 * resizes[1][2]["seconds"],
                "moved_blocks": resizes[0][2]["num_moved_blocks"],
                "preempted": resizes[0][2]["num_preempted"],
                "GiB": (
                    resizes[0][2]["previous_committed_bytes"] - resizes[0][2]["committed_bytes"]
                )
                / GiB,
            }
    figures["same_tokens"] = tokens["True"] == tokens["False"]
    return {f"b{batch} decoding": figures}


# --- two engines sharing the device ---------------------------------------------------

SHARED_PHASES = 4  # alternating: engine 0 busy, then engine 1, then 0, then 1
SHARED_OUTPUT_LEN = 128


def shared_worker(args: argparse.Namespace) -> None:
    """One of the two engines of `shared`: waits for its turns (files in --work), runs
    a burst each, idles through the other's; prints one JSON line of figures per burst."""
    work = Path(args.work)
    llm = LLM(
        str(args.model),
        enable_extensible_kv_cache=True,
        kv_cache_policy="elastic",
        kv_idle_release_s=args.idle_release_s,
        gpu_memory_utilization=args.share_utilization,
        max_model_len=args.share_prompt_len + SHARED_OUTPUT_LEN,
        max_num_seqs=args.share_batch,
    )
    (work / f"ready{args.index}").touch()
    vocab = llm.engine.vocab_size
    for phase in range(SHARED_PHASES):
        while not (work / f"go{phase}").exists():
            llm.engine.release_idle_kv_cache()  # idle: what the server's idle loop does
            time.sleep(0.05)
        if phase % 2 != args.index:
            continue
        prompts = random_prompts(args.share_batch, vocab, args.share_prompt_len, seed=phase)
        start = time.perf_counter()
        out = _greedy(llm, prompts, SHARED_OUTPUT_LEN)
        seconds = time.perf_counter() - start
        status = llm.kv_cache_status()
        line = {
            "phase": phase,
            "engine": args.index,
            "tok_s": sum(len(t) for t in out) / seconds,
            "prompt_tok_s": len(prompts) * args.share_prompt_len / seconds,
            "seconds": seconds,
            "num_blocks": status["num_blocks"],
            "committed_GiB": status["committed_bytes"] / GiB,
        }
        print("RESULT " + json.dumps(line), flush=True)
        (work / f"done{phase}").touch()
    llm.close()


def shared_engines(args: argparse.Namespace) -> Rows:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for f in work.iterdir():
        f.unlink()
    command = [sys.executable, __file__, "--shared-worker", "--work", str(work)]
    command += ["--model", str(args.model), "--share-batch", str(args.share_batch)]
    command += ["--share-utilization", str(args.share_utilization)]
    command += ["--idle-release-s", str(args.idle_release_s)]
    command += ["--share-prompt-len", str(args.share_prompt_len)]
    procs: list[subprocess.Popen] = []
    for i in range(2):  # one after the other: each start-up profiles the device alone
        procs.append(
            subprocess.Popen([*command, "--index", str(i)], stdout=subprocess.PIPE, text=True)
        )
        _wait_for(lambda i=i: (work / f"ready{i}").exists(), procs, 900)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the device's memory in use, every 20 ms
        total = torch.cuda.mem_get_info()[1]
        while not stop.is_set():
            peak[0] = max(peak[0], total - torch.cuda.mem_get_info()[0])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        for phase in range(SHARED_PHASES):
            (work / f"go{phase}").touch()
            _wait_for(lambda p=phase: (work / f"done{p}").exists(), procs, 900)
            time.sleep(args.idle_release_s + 1)  # the busy one goes idle and gives back
    finally:
        stop.set()
        outs = [p.communicate(timeout=300)[0] for p in procs]
    rows: Rows = {}
    for out in outs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                rows[f"phase {r['phase']} engine {r['engine']}"] = r
    peak_gib = peak[0] / GiB
    for row in rows.values():
        row["device_peak_GiB"] = peak_gib
    return dict(sorted(rows.items()))


def _wait_for(ready, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit("an engine of `shared` exited early")
        if time.monotonic() > deadline:
            raise SystemExit(f"`shared` waited more than {timeout:.0f} s")
        time.sleep(0.05)


# --- main -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights-gib", type=float, default=4.0)
    parser.add_argument("--kv-gib", type=float, default=16.0)
    parser.add_argument("--resize-gib", type=float, nargs="+", default=[1, 8, 32])
    parser.add_argument("--batch", type=int, default=64, help="requests decoding in `during`")
    parser.add_argument(
        "--share-batch",
        type=int,
        default=160,
        help="requests of a burst in `shared` (160 x 4096 tokens: 70 GiB of KV cache on the "
        "Qwen3-0.6B shape, so two bursts at once would not fit the H200)",
    )
    parser.add_argument("--share-prompt-len", type=int, default=3968)
    parser.add_argument("--share-utilization", type=float, default=0.6)
    parser.add_argument("--idle-release-s", type=float, default=1.0)
    parser.add_argument(
        "--engine-utilization",
        type=float,
        nargs="+",
        default=[0.9, 0.5],
        help="gpu_memory_utilization of each `engine` run (CUDA): 0.9 is the default's; 0.5 "
        "of the H200 leaves about the KV cache 0.9 of vLLM's A100 anchor had (80 GB)",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["mechanism", "engine", "during", "shared"],
        choices=["mechanism", "engine", "during", "shared"],
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--shared-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tms-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", default="/tmp/extkv-bench/shared")
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    return parser


COLUMNS = {
    "mechanism": [
        ("GiB", "GiB", ".2f"),
        ("sleep_s", "sleep s", ".4f"),
        ("wake_s", "wake s", ".4f"),
        ("sleep_GiB_s", "sleep GiB/s", ".1f"),
        ("wake_GiB_s", "wake GiB/s", ".1f"),
    ],
    "resize": [
        ("GiB", "GiB", ".2f"),
        ("shrink_s", "shrink s", ".4f"),
        ("grow_s", "grow s", ".4f"),
        ("shrink_GiB_s", "shrink GiB/s", ".1f"),
        ("grow_GiB_s", "grow GiB/s", ".1f"),
    ],
    "during": [
        ("median_step_ms", "step ms", ".3f"),
        ("shrink_step_ms", "w/ shrink", ".3f"),
        ("grow_step_ms", "w/ grow", ".3f"),
        ("shrink_ms", "shrink ms", ".2f"),
        ("grow_ms", "grow ms", ".2f"),
        ("GiB", "GiB", ".2f"),
        ("moved_blocks", "moved", "d"),
        ("preempted", "preempted", "d"),
    ],
    "shared": [
        ("tok_s", "tok/s", ".0f"),
        ("prompt_tok_s", "prompt tok/s", ".0f"),
        ("seconds", "s", ".2f"),
        ("num_blocks", "blocks", "d"),
        ("committed_GiB", "KV GiB", ".2f"),
        ("device_peak_GiB", "peak GiB", ".2f"),
    ],
}


def main() -> None:
    args = build_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.shared_worker:
        shared_worker(args)
        return
    if args.tms_child:
        rows = tms_mechanism(
            int(args.weights_gib * GiB), int(args.kv_gib * GiB), torch.device("cuda")
        )
        print("TMS " + json.dumps(rows), flush=True)
        return
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.weights_gib, args.kv_gib, args.resize_gib = 0.0625, 0.25, [0.0625]
        args.batch = 4
    results: dict[str, Rows] = {}

    def done(name: str, rows: Rows) -> None:  # each table as soon as it is measured
        results[name] = rows
        print_table(
            f"elastic {name} ({device.type})", rows, COLUMNS.get(name, COLUMNS["mechanism"])
        )
        same = {case: row["same_tokens"] for case, row in rows.items() if "same_tokens" in row}
        if same:
            print(f"   same greedy tokens: {same}", flush=True)
        write_json(args.json, results)

    model = qwen3_0_6b_checkpoint() if cuda else tiny_checkpoint()
    args.model = model
    if "shared" in args.sections and cuda:  # first: nothing of this process holds memory yet
        done("shared", shared_engines(args))
    if {"engine", "during"} & set(args.sections):
        options = {} if cuda else {"device": "cpu", "cpu_memory_budget_bytes": 512 << 20}
        utilizations = args.engine_utilization if cuda else [None]
        if "engine" not in args.sections:
            utilizations = utilizations[:1]  # `during` runs on the first engine only
        engine_rows: Rows = {}
        for index, utilization in enumerate(utilizations):
            if utilization is not None:
                options["gpu_memory_utilization"] = utilization
            llm = LLM(
                str(model),
                enable_extensible_kv_cache=True,
                enable_sleep_mode=True,
                max_model_len=1024,
                **options,
            )
            vocab = llm.engine.vocab_size
            if "engine" in args.sections:
                label = "engine" if utilization in (None, 0.9) else f"engine {utilization}"
                engine_rows |= engine_sleep(llm, device, vocab, label)
                done("engine", engine_rows)
                if index == 0:
                    done("resize", engine_resizes(llm, device, args.resize_gib))
            if "during" in args.sections and index == 0:
                resize_gib = args.resize_gib[0] if args.smoke else 8
                done("during", decode_during_resize(llm, vocab, args.batch, resize_gib))
            llm.close()
            del llm
            if cuda:
                torch.cuda.empty_cache()
    if "mechanism" in args.sections:
        weights, kv = int(args.weights_gib * GiB), int(args.kv_gib * GiB)
        rows = extkv_mechanism(weights, kv, device)
        if cuda:
            rows |= host_copy_ways(weights, device)
            rows |= tms_in_child(args)
        done("mechanism", rows)


if __name__ == "__main__":
    main()
