"""Decode throughput of a hybrid attention + Mamba2 model: extkv vs transformers, one run.

    python benchmarks/bench_hybrid.py [--batch-sizes 1 64] [--json OUT]

Random bf16 weights of BAMBA_BENCH_SHAPE (16 layers, 3 of them attention),
256-token prompts, 128 output tokens, greedy; decode-only figures remove the
prefill as in bench_decode.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import transformers

from _common import decode_throughput, hf_decode_throughput
from extkv import LLM
from extkv.demo import BAMBA_BENCH_SHAPE, make_random_checkpoint

PROMPT_LEN, OUTPUT_LEN = 256, 128


def bamba_checkpoint(folder: str = "/tmp/extkv-bench/bamba") -> Path:
    path = Path(folder)
    if not (path / "config.json").exists():
        make_random_checkpoint(
            path, "bamba", with_tokenizer=False, dtype=torch.bfloat16, **BAMBA_BENCH_SHAPE
        )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = bamba_checkpoint()
    vocab = BAMBA_BENCH_SHAPE["vocab_size"]
    rows: dict[int, dict[str, float]] = {}
    llm = LLM(
        str(path),
        enable_extensible_kv_cache=True,
        max_model_len=PROMPT_LEN + OUTPUT_LEN + 16,
        max_num_seqs=max(args.batch_sizes),
    )
    for batch in args.batch_sizes:
        e2e, decode = decode_throughput(llm, batch, vocab, PROMPT_LEN, OUTPUT_LEN)
        rows[batch] = {"extkv_tok_s": e2e, "extkv_decode_tok_s": decode}
    report = llm.memory_report()
    llm.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    for batch in args.batch_sizes:
        e2e, decode = hf_decode_throughput(model, batch, vocab, PROMPT_LEN, OUTPUT_LEN)
        rows[batch].update(hf_tok_s=e2e, hf_decode_tok_s=decode)
    print(f"hybrid: {report['num_blocks']} blocks of {report['block_size']} tokens")
    print(f"{'batch':>5} {'extkv':>9} {'hf':>8} {'ratio':>6} {'dec extkv':>10} {'dec hf':>8}")
    for batch, r in rows.items():
        print(
            f"{batch:>5} {r['extkv_tok_s']:>9.0f} {r['hf_tok_s']:>8.0f} "
            f"{r['extkv_tok_s'] / r['hf_tok_s']:>6.1f} {r['extkv_decode_tok_s']:>10.0f} "
            f"{r['hf_decode_tok_s']:>8.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": report, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
