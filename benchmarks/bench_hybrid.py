"""Decode throughput of a hybrid attention + Mamba2 model: extkv vs transformers, one run.

    python benchmarks/bench_hybrid.py [--batch-sizes 1 64] [--baseline-src DIR] [--json OUT]
    python benchmarks/bench_hybrid.py --smoke   # tiny Bamba on the CPU: proves it runs

Random bf16 weights of BAMBA_BENCH_SHAPE (16 layers, 3 of them attention),
256-token prompts, 128 output tokens, greedy; decode-only figures remove the
prefill as in bench_decode. With --baseline-src an older extkv tree runs the same
(each tree in a process of its own) and the tables show both with after/before
ratios; transformers runs once, after them, in this process.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch
import transformers

from _common import (
    SMOKE_DECODE,
    Column,
    DecodeSetting,
    Rows,
    benchmark_parser,
    decode_throughput,
    engine_options,
    hf_decode_throughput,
    measure_and_report,
    random_checkpoint,
    tiny_checkpoint,
)
from extkv import LLM

logger = logging.getLogger("bench_hybrid")
COLUMNS: list[Column] = [
    ("extkv_tok_s", "extkv", ".0f"),
    ("hf_tok_s", "hf", ".0f"),
    ("vs_hf", "ratio", ".1f"),
    ("extkv_decode_tok_s", "dec extkv", ".0f"),
    ("hf_decode_tok_s", "dec hf", ".0f"),
    ("num_blocks", "blocks", ".0f"),
    ("block_size", "block", ".0f"),
]


def checkpoint(args) -> Path:
    if args.smoke:
        return tiny_checkpoint("bamba")
    return random_checkpoint("/tmp/extkv-bench/bamba", "bamba", "BAMBA_BENCH_SHAPE")


def vocab_size(path: Path) -> int:
    return transformers.AutoConfig.from_pretrained(path).vocab_size


def measure(args) -> Rows:
    """extkv's figures per batch size (and its KV cache's blocks)."""
    setting = SMOKE_DECODE if args.smoke else DecodeSetting()
    path = checkpoint(args)
    batch_sizes = args.batch_sizes or list(setting.batch_sizes)
    llm = LLM(
        str(path),
        enable_extensible_kv_cache=True,
        max_model_len=setting.prompt_len + setting.output_len + 16,
        max_num_seqs=max(batch_sizes),
        **engine_options(args.smoke),
    )
    memory = llm.memory_report()
    rows: Rows = {}
    for batch in batch_sizes:
        e2e, decode = decode_throughput(
            llm, batch, vocab_size(path), setting.prompt_len, setting.output_len
        )
        rows[f"b{batch}"] = {
            "extkv_tok_s": e2e,
            "extkv_decode_tok_s": decode,
            "num_blocks": memory.get("num_blocks"),
            "block_size": memory.get("block_size"),
        }
    llm.close()
    return rows


def add_transformers(args, rows: Rows) -> None:
    """transformers `generate` on the same prompts, into `rows` (this tree's)."""
    setting = SMOKE_DECODE if args.smoke else DecodeSetting()
    path = checkpoint(args)
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    for case, row in rows.items():
        batch = int(case.removeprefix("b"))
        try:
            e2e, decode = hf_decode_throughput(
                model, batch, vocab_size(path), setting.prompt_len, setting.output_len
            )
        except torch.OutOfMemoryError as e:  # its scan's scores at b64 want 64 GiB at once
            logger.warning("transformers at %s: out of memory, left out (%s)", case, e)
            torch.cuda.empty_cache()
            continue
        row |= {"hf_tok_s": e2e, "hf_decode_tok_s": decode, "vs_hf": row["extkv_tok_s"] / e2e}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 64 (smoke: 1 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny Bamba on the CPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    checkpoint(args)  # here, before any child: built by this tree's extkv.demo
    measure_and_report(args, measure, "hybrid", COLUMNS, add=partial(add_transformers, args))


if __name__ == "__main__":
    main()
