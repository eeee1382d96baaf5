"""Decode throughput: extkv legacy vs extensible (and extensible with synchronous
scheduling) vs transformers `generate`, one run.

    python benchmarks/bench_decode.py [--batch-sizes 1 16 64 256] [--json OUT]

Each batch gets random 512-token prompts and generates 256 tokens. Decode
tokens/s comes from the difference of a 256-token and a 1-token run (so the
prefill drops out); the roofline is the bytes one decode step must read
(weights + the KV of every sequence) over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import logging

import torch
import transformers

from _common import (
    decode_throughput,
    device_bandwidth,
    hf_decode_throughput,
    qwen3_0_6b_checkpoint,
    write_json,
)
from extkv import LLM

PROMPT_LEN, OUTPUT_LEN = 512, 256


def roofline_tokens_per_s(batch: int, weights: int, kv_per_token: int, bandwidth: float) -> float:
    mean_context = PROMPT_LEN + OUTPUT_LEN / 2
    step_bytes = weights + batch * mean_context * kv_per_token
    return batch * bandwidth / step_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = qwen3_0_6b_checkpoint()
    config = transformers.AutoConfig.from_pretrained(path)
    vocab = config.vocab_size
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    # Copy bandwidth counts bytes read + written; a decode step mostly reads.
    bandwidth = device_bandwidth()
    rows: dict[int, dict[str, float]] = {b: {} for b in args.batch_sizes}
    # The engines live side by side (a third of the GPU each) and take turns, twice
    # per batch size, best of two: none gets a warmer GPU or an emptier allocator.
    # "sync" is the extensible engine reading each step's tokens before the next.
    engines = {
        name: LLM(
            str(path),
            enable_extensible_kv_cache=extensible,
            async_scheduling=name != "sync",
            gpu_memory_utilization=0.3,
            max_model_len=PROMPT_LEN + OUTPUT_LEN + 16,
            max_num_seqs=max(args.batch_sizes),
        )
        for name, extensible in (("legacy", False), ("extensible", True), ("sync", True))
    }
    weights = engines["legacy"].memory_report()["weights_bytes"]
    for batch in args.batch_sizes:
        for _ in range(2):
            for name, llm in engines.items():
                e2e, decode = decode_throughput(llm, batch, vocab, PROMPT_LEN, OUTPUT_LEN)
                row = rows[batch]
                row[f"{name}_tok_s"] = max(row.get(f"{name}_tok_s", 0.0), e2e)
                row[f"{name}_decode_tok_s"] = max(row.get(f"{name}_decode_tok_s", 0.0), decode)
    for llm in engines.values():
        llm.close()
    del engines
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    for batch in args.batch_sizes:
        e2e, decode = hf_decode_throughput(model, batch, vocab, PROMPT_LEN, OUTPUT_LEN)
        rows[batch]["hf_tok_s"] = e2e
        rows[batch]["hf_decode_tok_s"] = decode
        rows[batch]["roofline_tok_s"] = roofline_tokens_per_s(
            batch, weights, kv_per_token, bandwidth
        )
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; prompts {PROMPT_LEN}, outputs {OUTPUT_LEN}")
    header = (
        f"{'batch':>5} {'legacy':>9} {'extens':>9} {'ext/leg':>7} {'hf':>8} {'ext/hf':>7}"
        f" {'dec ext':>9} {'dec hf':>8} {'roofline':>9} {'of roof':>7}"
        f" {'dec sync':>9} {'async/sync':>10}"
    )
    print("tok/s (end to end; 'dec' = decode only, prefill removed)")
    print(header)
    for batch, r in rows.items():
        print(
            f"{batch:>5} {r['legacy_tok_s']:>9.0f} {r['extensible_tok_s']:>9.0f} "
            f"{r['extensible_tok_s'] / r['legacy_tok_s']:>7.3f} {r['hf_tok_s']:>8.0f} "
            f"{r['extensible_tok_s'] / r['hf_tok_s']:>7.1f} {r['extensible_decode_tok_s']:>9.0f} "
            f"{r['hf_decode_tok_s']:>8.0f} {r['roofline_tok_s']:>9.0f} "
            f"{r['extensible_decode_tok_s'] / r['roofline_tok_s']:>7.2f} "
            f"{r['sync_decode_tok_s']:>9.0f} "
            f"{r['extensible_decode_tok_s'] / r['sync_decode_tok_s']:>10.2f}"
        )
    write_json(args.json, {"bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
