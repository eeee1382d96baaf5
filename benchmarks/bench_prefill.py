"""Prefill MFU on the Qwen3-0.6B shape: one 8,192-token prompt, and 4 x 2,048, each in
one engine step.

    python benchmarks/bench_prefill.py [--peak-flops 989.4e12] [--baseline-src DIR] [--json OUT]
    python benchmarks/bench_prefill.py --smoke   # tiny model on the CPU: proves it runs

A case is `LLM.generate` of its prompts (random token ids, fresh ones every call, so
no cache could help) with max_tokens=1 and synchronous scheduling: one step that
prefills every prompt (max_num_batched_tokens is the case's token count) and samples
each sequence's first token, and nothing else. One warm-up call, then:

- wall ms: the median of `REPEATS` calls, each timed end to end (device synchronised).
- gpu ms, kernels: the CUDA kernels torch.profiler records over one more call, their
  durations summed, and their count.
- TFLOP, counted as: 2 x P x T for the weight matmuls, where P is the number of
  parameters of the decoder layers and the final norm (every tensor of the checkpoint
  but the token embedding and lm_head) and T the tokens of the case; plus 2 x hidden x
  vocab per sequence for the logits (the engine computes them for the sampled last
  token only); plus attention, causal, per sequence of L tokens: QK^T and PV are
  2 x heads x head_dim x L^2 / 2 FLOPs each in every layer, so
  2 x layers x heads x head_dim x L^2 together (the masked half is not counted).
  Norms, activations and rotary count as 2 FLOPs per parameter at most (in P) or not
  at all.
- MFU: TFLOP / time / --peak-flops (the H200's dense bf16 peak by default), for the
  wall time and for the gpu time.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from _common import (
    Column,
    Rows,
    benchmark_parser,
    engine_options,
    measure_and_report,
    profile_kernels,
    qwen3_0_6b_checkpoint,
    random_prompts,
    synchronize,
    tiny_checkpoint,
)
from extkv import LLM, SamplingParams

logger = logging.getLogger("bench_prefill")
H200_BF16_DENSE_FLOPS = 989.4e12
REPEATS = 3
COLUMNS: list[Column] = [
    ("tokens", "tokens", ".0f"),
    ("wall_ms", "wall ms", ".2f"),
    ("gpu_ms", "gpu ms", ".2f"),
    ("kernels", "kernels", ".0f"),
    ("tflop", "TFLOP", ".2f"),
    ("mfu_wall", "MFU wall", ".3f"),
    ("mfu_gpu", "MFU gpu", ".3f"),
    ("tok_s", "tok/s", ".0f"),
]


@dataclass(frozen=True)
class Case:
    """`seqs` prompts of `length` tokens, prefilled in one step."""

    seqs: int
    length: int

    @property
    def name(self) -> str:
        return f"{self.seqs}x{self.length}"


CASES = [Case(1, 8192), Case(4, 2048)]
SMOKE_CASES = [Case(1, 256), Case(4, 64)]


def layer_parameters(checkpoint: Path) -> int:
    """Parameters of every tensor of the checkpoint but the token embedding and lm_head
    (from the safetensors headers; nothing is loaded)."""
    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names = list(f.keys())  # a safe_open handle is not iterable
            total += sum(
                math.prod(f.get_slice(name).get_shape())
                for name in names
                if "embed_tokens" not in name and not name.startswith("lm_head")
            )
    return total


def prefill_flops(config: dict, params: int, case: Case) -> float:
    """The module docstring's count."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    tokens = case.seqs * case.length
    weights = 2 * params * tokens
    logits = 2 * config["hidden_size"] * config["vocab_size"] * case.seqs
    per_length = 2 * config["num_hidden_layers"] * config["num_attention_heads"] * head_dim
    attention = per_length * case.length**2 * case.seqs
    return float(weights + logits + attention)


def checkpoint(args) -> Path:
    return tiny_checkpoint("qwen3") if args.smoke else qwen3_0_6b_checkpoint()


def measure(args) -> Rows:
    path = checkpoint(args)
    config = json.loads((path / "config.json").read_text())
    params = layer_parameters(path)
    cases = SMOKE_CASES if args.smoke else CASES
    tokens = max(c.seqs * c.length for c in cases)
    llm = LLM(
        str(path),
        async_scheduling=False,
        enforce_eager=True,  # decode graphs play no part in a prefill
        max_num_seqs=max(c.seqs for c in cases),
        max_num_batched_tokens=tokens,
        max_model_len=max(c.length for c in cases) + 16,
        **engine_options(args.smoke),
    )
    params_one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    calls = iter(range(1, 1_000_000))  # a fresh seed, so fresh prompts, every call

    def run(case: Case) -> None:
        ids = random_prompts(case.seqs, config["vocab_size"], case.length, seed=next(calls))
        llm.generate(prompt_token_ids=ids, sampling_params=params_one, use_tqdm=False)

    rows: Rows = {}
    for case in cases:
        run(case)  # warm-up
        times = []
        for _ in range(REPEATS):
            synchronize()
            start = time.perf_counter()
            run(case)
            synchronize()
            times.append(time.perf_counter() - start)
        wall = statistics.median(times)
        row = {"tokens": case.seqs * case.length, "wall_ms": wall * 1e3}
        row |= profile_kernels(functools.partial(run, case), 1)
        flops = prefill_flops(config, params, case)
        row |= {
            "tflop": flops / 1e12,
            "mfu_wall": flops / wall / args.peak_flops,
            "mfu_gpu": flops / (row["gpu_ms"] / 1e3) / args.peak_flops,
            "tok_s": row["tokens"] / wall,
            "layer_parameters": params,
        }
        rows[case.name] = row
    llm.close()
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=H200_BF16_DENSE_FLOPS,
        help="the device's peak FLOP/s for MFU (default: the H200's dense bf16, %(default)s)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    checkpoint(args)  # here, before any child: built by this tree's extkv.demo
    title = f"prefill (peak {args.peak_flops / 1e12:.1f} TFLOP/s)"
    measure_and_report(args, measure, title, COLUMNS)


if __name__ == "__main__":
    main()
