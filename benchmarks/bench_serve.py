"""Online serving: a live `extkv serve` under a fixed request rate, measured from the
client with the official openai client, in the terms of vLLM's `benchmark_serving`.

    python benchmarks/bench_serve.py --model PATH [--num-prompts 1000] [--input-len 1024]
        [--output-len 128] [--request-rate inf] [--max-concurrency N] [--json OUT]
        [--server-src SRC] [-- FLAGS OF extkv serve]
    python benchmarks/bench_serve.py --base-url http://HOST:PORT --vocab-size V [...]

The first form starts `extkv serve` on a free loopback port (the flags after `--` go
to it; --server-src runs it from another extkv src/ tree, e.g. a baseline's), waits
for /health and stops it with SIGINT at the end; its log goes to
`--server-log` (default: a temporary file, named in the log). The second measures a
server already running. Without --model and --base-url it serves the tiny demo model;
on the CPU, from the repository root:

    PYTHONPATH=src:benchmarks python benchmarks/bench_serve.py --num-prompts 20 \\
        --input-len 32 --output-len 16 --request-rate 10 -- --device=cpu \\
        --cpu-memory-budget-bytes=268435456 --max-model-len=1024 --max-num-batched-tokens=512

Workload: `--num-prompts` random prompts of `--input-len` token ids (seeded; sent as
ids to /v1/completions, so no tokenizer is involved), each asked for exactly
`--output-len` tokens (`ignore_eos`), streamed, greedy unless --temperature.
`--num-warmups` requests (one; prompts of their own) run before the clock starts.
Arrivals: gaps drawn from a gamma distribution of shape `--burstiness` and mean
1/`--request-rate` (burstiness 1 is a Poisson process; lower is burstier), rescaled
so that the last request leaves at num_prompts / rate, as vLLM does; `inf` sends
them all at once. `--max-concurrency` caps the requests in flight; a request's clock
starts when the cap lets it through.

Figures, as vLLM defines them: TTFT is from sending a request to its first token
chunk; ITL the gaps between successive token chunks (all requests pooled); E2E
latency from sending to the last token chunk; TPOT (E2E - TTFT) / (output tokens - 1),
over requests of two tokens or more. Each gets its mean, median, standard deviation
and `--percentiles` (numpy's linear interpolation). Output tokens are the token ids
the server returned (checked against its `usage`), not --output-len. Throughputs are
over the duration: from the first dispatch to the last response, failures included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import openai
from tqdm import tqdm

from _common import env_with_src, random_prompts

logger = logging.getLogger("bench_serve")
METRICS = (  # key, heading, short name
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds, from `time.perf_counter`."""

    prompt_len: int
    start: float = 0.0  # when it was sent (after --max-concurrency let it through)
    queued: float = 0.0  # how long --max-concurrency held it back
    ttft: float = 0.0
    latency: float = 0.0  # to the last token chunk
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # token ids received
    usage_tokens: int | None = None  # the server's usage.completion_tokens
    finish_reason: str | None = None
    error: str | None = None


# --- the server ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def launched_server(
    model: Path, flags: list[str], log: Path, timeout: float, src: Path | None = None
) -> Iterator[str]:
    """`extkv serve` on a free loopback port until the block ends (`src`: an extkv src/
    tree to run it from, first on its PYTHONPATH); yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The address comes last, so it wins over any in `flags`.
    command = [sys.executable, "-m", "extkv.cli", "serve", f"--model={model}", *flags]
    command += ["--host=127.0.0.1", f"--port={port}"]
    env = env_with_src(src)
    logger.info("starting %s (log: %s; extkv from %s)", " ".join(command), log, src or "here")
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited ({process.returncode}):\n{log_tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not ready in {timeout:.0f} s:\n{log_tail(log)}")
            time.sleep(0.5)
        logger.info("server ready at %s", url)
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                logger.warning("the server ignored SIGINT for 60 s; killing it")
                process.kill()
                process.wait()
        logger.info("server stopped (exit status %s)", process.returncode)


def checkpoint_vocab_size(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        if "vocab_size" in section:
            return int(section["vocab_size"])
    raise SystemExit(f"no vocab_size in {model / 'config.json'}; pass --vocab-size")


def raise_open_files_limit() -> None:
    """Every request in flight holds a socket; let there be as many as the system allows
    (the launched server inherits this too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the client ----------------------------------------------------------------------


async def send(
    client: openai.AsyncOpenAI, model: str, prompt: list[int], args: argparse.Namespace
) -> RequestResult:
    """One streamed completion, timed chunk by chunk."""
    result = RequestResult(len(prompt))
    saw_token_ids = False
    chunks = 0
    result.start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=args.output_len,
            temperature=args.temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    result.usage_tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                result.finish_reason = choice.finish_reason or result.finish_reason
                token_ids = getattr(choice, "token_ids", None)  # extkv's and vLLM's extension
                if token_ids is not None:
                    saw_token_ids = True
                    result.output_tokens += len(token_ids)
                    if not token_ids:
                        continue  # no token in it: not a token chunk
                if chunks == 0:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = last - result.start
    if chunks == 0:
        result.error = "the stream ended without a token"
    elif not saw_token_ids:  # a server without return_token_ids: trust its usage
        result.output_tokens = result.usage_tokens if result.usage_tokens is not None else chunks
    return result


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request leaves, in seconds after the first dispatch."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist()  # the whole run spans n / rate


async def run_benchmark(
    base_url: str, prompts: list[list[int]], warmups: list[list[int]], args: argparse.Namespace
) -> tuple[list[RequestResult], float, dict]:
    """Send `warmups` one by one, then `prompts` on schedule; (results, duration s, facts)."""
    # Our own connection pool: openai's default stops at 1000 connections, and the
    # extra requests would wait in the client, counted as the server's TTFT.
    http = httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency
        ),
        timeout=httpx.Timeout(args.timeout, connect=30.0),
    )
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=args.api_key, max_retries=0, http_client=http
    )
    async with client:
        try:
            card = (await client.models.list()).data[0]
        except openai.APIError as e:
            raise SystemExit(f"{base_url}/v1/models: {e}") from None
        model = args.served_model_name or card.id
        max_model_len = getattr(card, "max_model_len", None)  # extkv's and vLLM's extension
        if max_model_len is not None and args.input_len + args.output_len > max_model_len:
            raise SystemExit(
                f"--input-len {args.input_len} + --output-len {args.output_len} is more than "
                f"the server's max_model_len={max_model_len}"
            )
        facts = {"served_model_name": model, "max_model_len": max_model_len}
        for prompt in warmups:
            warm = await send(client, model, prompt, args)
            if warm.error is not None:
                raise SystemExit(f"the warm-up request failed: {warm.error}")
        logger.info("warm-up done (%d request(s)); sending %d", len(warmups), len(prompts))

        offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
        cap = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        progress = tqdm(total=len(prompts), desc="requests", disable=args.disable_tqdm)

        async def one(prompt: list[int]) -> RequestResult:
            arrived = time.perf_counter()
            async with cap or contextlib.nullcontext():
                result = await send(client, model, prompt, args)
            result.queued = result.start - arrived
            progress.update()
            return result

        tasks = []
        cpu_start, start = time.process_time(), time.perf_counter()
        for prompt, offset in zip(prompts, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        facts["client_cpu_s"] = time.process_time() - cpu_start
        progress.close()
    for r in results:
        r.start -= start  # seconds into the run, for the JSON
    return results, duration, facts


# --- the figures ---------------------------------------------------------------------


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once (as the client saw them)."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results])
    peak = current = 0
    for _, step in events:  # at a tie the ending request (-1) goes first
        current += step
        peak = max(peak, current)
    return peak


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    done = [r for r in results if r.error is None]
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    out: dict[str, float | int] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_concurrent_requests": peak_concurrency(done),
    }
    for key, values in samples.items():
        ms = np.asarray(values or [0.0]) * 1e3
        out[f"mean_{key}_ms"] = float(ms.mean())
        out[f"median_{key}_ms"] = float(np.median(ms))
        out[f"std_{key}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{p:g}_{key}_ms"] = float(np.percentile(ms, p))
    return out


def check_token_counts(results: list[RequestResult], output_len: int) -> None:
    done = [r for r in results if r.error is None]
    if mismatched := [r for r in done if r.usage_tokens not in (None, r.output_tokens)]:
        r = mismatched[0]
        logger.warning(
            "%d requests: token ids received differ from usage.completion_tokens (e.g. %d vs %d)",
            len(mismatched),
            r.output_tokens,
            r.usage_tokens,
        )
    if short := [r for r in done if r.output_tokens != output_len]:
        logger.warning(
            "%d requests did not return %d tokens (e.g. %d, finish_reason %s)",
            len(short),
            output_len,
            short[0].output_tokens,
            short[0].finish_reason,
        )
    errors = Counter(r.error for r in results if r.error is not None)
    for error, count in errors.most_common(5):
        logger.error("%d failed request(s): %s", count, error)


def print_table(m: dict, args: argparse.Namespace) -> None:
    def row(label: str, value: float | int) -> None:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40} {shown}")

    print(f"{' Serving Benchmark Result ':=^50}")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if args.max_concurrency:
        row("Maximum request concurrency:", args.max_concurrency)
    row("Request rate configured (RPS):", args.request_rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    for key, heading, short in METRICS:
        print(f"{heading:-^50}")
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", m[f"median_{key}_ms"])
        for p in (p for p in args.percentiles if p != 50):  # 50 is the median
            row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"])
    print("=" * 50)


def jsonable(value: object) -> object:
    """Paths as strings, and inf as "inf" (JSON has no infinity)."""
    if isinstance(value, Path) or value == float("inf"):
        return str(value)
    return value


def git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip()


# --- the command ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        usage="%(prog)s [options] [-- FLAGS OF extkv serve]",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--model", type=Path, help="checkpoint folder to serve (default: the tiny demo model)"
    )
    server.add_argument("--base-url", help="measure this running server instead, e.g. http://h:80")
    server.add_argument("--served-model-name", help="default: the first of /v1/models")
    server.add_argument("--api-key", help="default: $EXTKV_API_KEY, else none")
    server.add_argument("--server-log", type=Path, help="default: a temporary file")
    server.add_argument(
        "--server-src",
        type=Path,
        help="run the launched server from this extkv src/ tree (e.g. a baseline's)",
    )
    server.add_argument(
        "--server-timeout", type=float, default=900, help="seconds to start (%(default)s)"
    )
    work = parser.add_argument_group("workload")
    work.add_argument("--num-prompts", type=int, default=1000, help="requests (%(default)s)")
    work.add_argument(
        "--input-len", type=int, default=1024, help="token ids per prompt (%(default)s)"
    )
    work.add_argument(
        "--output-len", type=int, default=128, help="tokens per request (%(default)s)"
    )
    work.add_argument("--vocab-size", type=int, help="prompt ids are below it (--model's config)")
    work.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (%(default)s)")
    work.add_argument("--seed", type=int, default=0, help="of prompts and arrivals (%(default)s)")
    work.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s; inf = all at once (%(default)s)",
    )
    work.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson (%(default)s)"
    )
    work.add_argument("--max-concurrency", type=int, help="most requests in flight (no limit)")
    work.add_argument(
        "--num-warmups", type=int, default=1, help="requests before the clock (%(default)s)"
    )
    work.add_argument(
        "--timeout", type=float, default=600, help="seconds without a byte (%(default)s)"
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--percentiles", type=float, nargs="+", default=[99.0], help="of each (%(default)s)"
    )
    out.add_argument("--json", type=Path, help="every figure, per request too")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_flags: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, server_flags = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.base_url and (server_flags or args.server_src):
        parser.error("the flags after -- and --server-src are for a server this launches")
    if not (args.request_rate > 0 and args.burstiness > 0):
        parser.error("--request-rate and --burstiness must be > 0")
    if min(args.num_prompts, args.input_len, args.output_len) < 1 or args.num_warmups < 0:
        parser.error("--num-prompts, --input-len, --output-len must be >= 1, --num-warmups >= 0")
    args.api_key = args.api_key or os.environ.get("EXTKV_API_KEY") or "none"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2"):  # a line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    raise_open_files_limit()

    if args.model is None and args.base_url is None:
        from extkv.demo import demo_checkpoint

        args.model = demo_checkpoint()
    vocab = args.vocab_size or (args.model and checkpoint_vocab_size(args.model))
    if not vocab:
        parser.error("with --base-url and no --model, --vocab-size is needed")
    # The warm-up prompts are extra ones: a timed prompt must not find its KV cached.
    total = args.num_prompts + args.num_warmups
    prompts = random_prompts(total, vocab, args.input_len, seed=args.seed)

    with contextlib.ExitStack() as stack:
        url = args.base_url
        if url is None:
            log = args.server_log
            if log is None:
                handle, name = tempfile.mkstemp(prefix="extkv-serve-", suffix=".log")
                os.close(handle)
                log = Path(name)
            url = stack.enter_context(
                launched_server(args.model, server_flags, log, args.server_timeout, args.server_src)
            )
        url = url.rstrip("/").removesuffix("/v1")
        results, duration, facts = asyncio.run(
            run_benchmark(url, prompts[: args.num_prompts], prompts[args.num_prompts :], args)
        )

    check_token_counts(results, args.output_len)
    metrics = summarize(results, duration, args.percentiles)
    if facts["client_cpu_s"] > 0.8 * duration:
        logger.warning(
            "the client was busy %.0f%% of the run: its own work may be inflating the "
            "latencies (give it a core of its own, or fewer requests in flight)",
            100 * facts["client_cpu_s"] / duration,
        )
    print_table(metrics, args)
    if args.json:
        record = {
            "date": datetime.now().isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "config": {
                **{k: jsonable(v) for k, v in vars(args).items() if k != "api_key"},
                "server_flags": server_flags,
                "base_url": url,
                "vocab_size": vocab,
                "served_model_name": facts["served_model_name"],
                "max_model_len": facts["max_model_len"],
            },
            **metrics,
            "client_cpu_s": facts["client_cpu_s"],
            "requests": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(record, indent=1))
        logger.info("wrote %s", args.json)
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
