"""Decode throughput of each attention kind on a real architecture's shape, legacy vs
extensible KV cache in one run, with the roofline fraction.

    python benchmarks/bench_kinds.py [--models mla gemma3] [--batch-sizes 1 64]
                                     [--num-layers N] [--json OUT]
    python benchmarks/bench_kinds.py --smoke   # tiny models on the CPU: proves it runs

Models (random bf16 weights, built once under /tmp/extkv-bench):
- `mla`: DeepSeek-V2-Lite's shape (multi-head latent attention, 27 layers, the first
  dense, the rest 64 routed experts of which 6 per token plus 2 shared);
- `gemma3`: Gemma3-1B's shape (26 layers, five sliding-window layers of 512 tokens to
  every global one, one KV head of 256).
`--num-layers` cuts the depth (the report says so) where building the full checkpoint
would not fit a device call.

1024-token prompts (past Gemma3's window), 128 output tokens, greedy, CUDA graphs.
`dec tok/s` is decode only (a 1-token run of the same prompts subtracted). `of roof`:
decode tok/s against the bytes a step must read at the device's measured copy
bandwidth: every weight once (the embedding table only where it is also the output
projection; of the routed experts the share that `batch` tokens of uniform routing
touch, E (1 - (1 - k/E)^batch) of E) plus each sequence's KV cache at the mean context
(prompt + half the output; a sliding layer reads at most its window).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import transformers

from _common import (
    GEMMA3_1B_SHAPE,
    Column,
    DecodeSetting,
    Rows,
    benchmark_parser,
    decode_throughput,
    device_bandwidth,
    engine_options,
    measure_and_report,
    random_checkpoint,
    random_prompts,
)
from extkv import LLM

COLUMNS: list[Column] = [
    ("legacy_decode_tok_s", "legacy dec", ".0f"),
    ("extensible_decode_tok_s", "ext dec", ".0f"),
    ("ext_vs_legacy", "ext/leg", ".3f"),
    ("extensible_tok_s", "ext e2e", ".0f"),
    ("of_roof", "of roof", ".3f"),
    ("roof_tok_s", "roof tok/s", ".0f"),
    ("num_blocks", "blocks", ".0f"),
    ("same_tokens", "same", ".0f"),
]

# DeepSeek-V2-Lite's config (yarn rope scaling left out: it changes no cost).
DEEPSEEK_V2_LITE_SHAPE = dict(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=2,
    n_routed_experts=64,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=4096,
    initializer_range=0.02,
    tie_word_embeddings=False,
)
# name -> (demo architecture, full shape)
MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "mla": ("deepseek_v2", DEEPSEEK_V2_LITE_SHAPE),
    "gemma3": ("gemma3", GEMMA3_1B_SHAPE),
}


SETTING = DecodeSetting(prompt_len=1024)
SMOKE = DecodeSetting(prompt_len=24, output_len=4, batch_sizes=(1, 2))


def _cut(shape: dict[str, object], num_layers: int | None) -> dict[str, object]:
    """`shape` with its first `num_layers` layers only (and their layer types)."""
    if num_layers is None:
        return shape
    cut = {**shape, "num_hidden_layers": num_layers}
    if "layer_types" in shape:
        cut["layer_types"] = shape["layer_types"][:num_layers]
    return cut


def checkpoint(name: str, args) -> Path:
    architecture, shape = MODELS[name]
    if args.smoke:  # the demo's tiny model of that architecture, MoE layers included
        moe = dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        )
        tiny = moe if name == "mla" else {}
        return random_checkpoint(f"/tmp/extkv-bench/tiny-kinds-{name}", architecture, **tiny)
    shape = _cut(shape, args.num_layers)
    layers = shape["num_hidden_layers"]
    folder = f"/tmp/extkv-bench/{name}-{layers}-layers"  # built on the GPU: 16B params
    return random_checkpoint(folder, architecture, shape, device="cuda")


def roof_step_bytes(config, batch: int, context: int) -> float:
    """Bytes one decode step of `batch` sequences of `context` tokens must read (see the
    module's docstring), from the model's parameter shapes on the meta device."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    experts = getattr(config, "n_routed_experts", None) or 0
    touched = experts * (1 - (1 - config.num_experts_per_tok / experts) ** batch) if experts else 0
    weights = 0.0
    for name, param in model.named_parameters(remove_duplicate=False):
        size = param.numel() * 2  # bf16
        if "embed_tokens" in name:
            size *= tied  # read as the output projection only when tied
        elif ".mlp.experts." in name:
            size *= touched / experts
        weights += size
    layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    window = getattr(config, "sliding_window", None) or context
    kv = 0.0
    for kind in layer_types[:layers]:
        tokens = min(context, window) if kind == "sliding_attention" else context
        if getattr(config, "kv_lora_rank", None):  # one latent row + the rope key
            per_token = config.kv_lora_rank + config.qk_rope_head_dim
        else:
            per_token = 2 * config.num_key_value_heads * config.head_dim
        kv += batch * tokens * per_token * 2
    return weights + kv


def measure(args) -> Rows:
    setting = SMOKE if args.smoke else SETTING
    batch_sizes = args.batch_sizes or list(setting.batch_sizes)
    bandwidth = None if args.smoke else device_bandwidth()
    rows: Rows = {}
    for name in args.models:
        path = checkpoint(name, args)
        config = transformers.AutoConfig.from_pretrained(path)
        tokens: dict[str, list] = {}
        for extensible in (False, True):
            kind = "extensible" if extensible else "legacy"
            llm = LLM(
                str(path),
                enable_extensible_kv_cache=extensible,
                max_model_len=setting.prompt_len + setting.output_len + 16,
                max_num_seqs=max(batch_sizes),
                **engine_options(args.smoke),
            )
            blocks = llm.memory_report().get("num_blocks")
            for batch in batch_sizes:
                case = f"{name} L{config.num_hidden_layers} b{batch}"
                e2e, decode = decode_throughput(
                    llm, batch, config.vocab_size, setting.prompt_len, setting.output_len
                )
                row = rows.setdefault(case, {})
                row[f"{kind}_tok_s"], row[f"{kind}_decode_tok_s"] = e2e, decode
                row["num_blocks"] = blocks
                tokens.setdefault(case, []).append(_greedy(llm, batch, config.vocab_size))
            llm.close()
        for case, (legacy, extensible) in tokens.items():
            row = rows[case]
            row["same_tokens"] = float(legacy == extensible)
            row["ext_vs_legacy"] = row["extensible_decode_tok_s"] / row["legacy_decode_tok_s"]
            if bandwidth is not None:
                batch = int(case.rsplit("b", 1)[1])
                context = setting.prompt_len + setting.output_len // 2
                row["roof_tok_s"] = batch * bandwidth / roof_step_bytes(config, batch, context)
                row["of_roof"] = row["extensible_decode_tok_s"] / row["roof_tok_s"]
    return rows


def _greedy(llm: LLM, batch: int, vocab: int) -> list[list[int]]:
    """Greedy tokens of a few prompts, to check legacy == extensible on this shape."""
    from extkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(
        prompt_token_ids=random_prompts(batch, vocab, 32, seed=7),
        sampling_params=params,
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 64 (smoke: 1 2)")
    parser.add_argument("--num-layers", type=int, help="cut each model to its first N layers")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in args.models:  # here, before any child: built by this tree's extkv.demo
        checkpoint(name, args)
    measure_and_report(args, measure, "kinds", COLUMNS)


if __name__ == "__main__":
    main()
