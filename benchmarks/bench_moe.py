"""Decode throughput of a mixture-of-experts model: the fused expert kernels (CUDA graphs,
and eager) against the reference loop (eager: it cannot be captured), one run.

    python benchmarks/bench_moe.py [--shape qwen3-30b-a3b|deepseek-v2-lite] [--layers 8]
        [--batch-sizes 1 64] [--json OUT]
    python benchmarks/bench_moe.py --smoke   # tiny Qwen3-MoE on the CPU: proves it runs

Random bf16 weights of Qwen3-30B-A3B's layers (128 experts, 8 per token) or
DeepSeek-V2-Lite's (MLA, 64 experts, 6 per token, 2 shared), `--layers` of them (the
whole models would not be built and saved within a device call), 256-token prompts, 128
output tokens, greedy; `dec tok/s` is decode only (the prefill removed as in
bench_decode). The reference loop is selected with EXTKV_FUSED_MOE=0. On the CPU
(--smoke) every engine runs the reference loop: it only proves the script runs.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import transformers

from _common import (
    SMOKE_DECODE,
    Column,
    DecodeSetting,
    Rows,
    decode_throughput,
    engine_options,
    print_table,
    random_checkpoint,
    tiny_checkpoint,
    write_json,
)
from bench_kinds import DEEPSEEK_V2_LITE_SHAPE
from extkv import LLM

# Qwen3-30B-A3B's config but its depth (48 layers: 61 GB in bf16).
QWEN3_30B_A3B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    initializer_range=0.02,
)
# name -> (demo architecture, shape); bench_kinds has DeepSeek-V2-Lite's.
SHAPES: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B_SHAPE),
    "deepseek-v2-lite": ("deepseek_v2", DEEPSEEK_V2_LITE_SHAPE),
}
# (name, EXTKV_FUSED_MOE, enforce_eager)
ENGINES = (("fused_graphs", "1", False), ("fused_eager", "1", True), ("reference", "0", True))
COLUMNS: list[Column] = [
    *((f"{name}_decode_tok_s", f"dec {name}", ".0f") for name, _, _ in ENGINES),
    ("graphs_vs_reference", "graphs/ref", ".2f"),
    ("eager_vs_reference", "eager/ref", ".2f"),
    *((f"{name}_tok_s", name, ".0f") for name, _, _ in ENGINES),
]


def moe_checkpoint(shape: str, layers: int, smoke: bool) -> Path:
    """The random checkpoint of `shape` with `layers` layers (built once, on the GPU); the
    tiny Qwen3-MoE for --smoke."""
    if smoke:
        return tiny_checkpoint("qwen3_moe")
    architecture, config = SHAPES[shape]
    folder = f"/tmp/extkv-bench/{shape}-{layers}-layers"
    return random_checkpoint(
        folder, architecture, {**config, "num_hidden_layers": layers}, device="cuda"
    )


def measure(args: argparse.Namespace) -> Rows:
    """Each engine's figures per batch size, the engines one after another."""
    setting = SMOKE_DECODE if args.smoke else DecodeSetting()
    batch_sizes = args.batch_sizes or list(setting.batch_sizes)
    path = moe_checkpoint(args.shape, args.layers, args.smoke)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    rows: Rows = {f"b{batch}": {} for batch in batch_sizes}
    for name, fused, eager in ENGINES:
        os.environ["EXTKV_FUSED_MOE"] = fused  # read by every MoE layer's call (this process)
        llm = LLM(
            str(path),
            enforce_eager=eager,
            max_model_len=setting.prompt_len + setting.output_len + 16,
            max_num_seqs=max(batch_sizes),
            **engine_options(args.smoke),
        )
        for batch in batch_sizes:
            e2e, decode = decode_throughput(
                llm, batch, vocab, setting.prompt_len, setting.output_len
            )
            rows[f"b{batch}"] |= {f"{name}_tok_s": e2e, f"{name}_decode_tok_s": decode}
        llm.close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in rows.values():
        reference = row["reference_decode_tok_s"]
        row["graphs_vs_reference"] = row["fused_graphs_decode_tok_s"] / reference
        row["eager_vs_reference"] = row["fused_eager_decode_tok_s"] / reference
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 64 (smoke: 1 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny Qwen3-MoE on the CPU")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    logging.basicConfig(level=logging.WARNING)
    if "EXTKV_FUSED_MOE" in os.environ:
        parser.error("EXTKV_FUSED_MOE is set: the benchmark sets it for each engine itself")
    rows = measure(args)
    shape = "tiny qwen3-moe (CPU)" if args.smoke else f"{args.shape}, {args.layers} layers"
    print_table(f"moe: {shape}", rows, COLUMNS)
    write_json(args.json, {"shape": shape, "rows": rows})


if __name__ == "__main__":
    main()
