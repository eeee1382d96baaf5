"""The `extkv` command: demo, generate, info."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from extkv.engine.config import DEFAULT_CPU_MEMORY_BUDGET, ENGINE_BACKENDS, EngineConfig

logger = logging.getLogger("extkv")


def _extensible(value: str) -> bool | str:
    choices = {"true": True, "false": False, "auto": "auto"}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected true, false or auto; got {value!r}")
    return choices[value.lower()]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every `LLM(...)` option, with its default."""
    g = parser.add_argument_group("engine")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    g.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16 or float16 (default: bf16 on CUDA, fp32 on CPU)",
    )
    g.add_argument(
        "--enable-extensible-kv-cache",
        type=_extensible,
        nargs="?",
        const=True,
        default=False,
        help="size the KV cache after CUDA-graph capture (true, false or auto)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="legacy path only")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 8192")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--attention-backend", choices=ENGINE_BACKENDS, default="split")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cpu-memory-budget-bytes", type=int, default=DEFAULT_CPU_MEMORY_BUDGET)
    g.add_argument("--kv-cache-margin-bytes", type=int, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"
    }


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def _generate(args: argparse.Namespace, model: str, prompts: list[str]) -> list:
    from extkv import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    outputs = llm.generate(prompts, params)
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    report = llm.memory_report()
    print(json.dumps(report, indent=1, default=str))
    return [o.outputs[0].token_ids for o in outputs]


def cmd_generate(args: argparse.Namespace) -> int:
    _generate(args, args.model, args.prompt)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Build the tiny checkpoint, generate with the legacy and the extensible KV cache,
    and check that both give the same tokens."""
    from extkv.demo import demo_checkpoint

    folder = demo_checkpoint()
    prompts = args.prompt or ["The extensible KV cache", "Once upon a time", "CUDA graphs"]
    args.ignore_eos = True
    results = {}
    for extensible in (False, True):
        args.enable_extensible_kv_cache = extensible
        print(f"--- {'extensible' if extensible else 'legacy'} KV cache")
        results[extensible] = _generate(args, str(folder), prompts)
    same = results[False] == results[True]
    print(f"legacy and extensible outputs identical: {same}")
    return 0 if same else 1


def cmd_info(args: argparse.Namespace) -> int:
    """Virtual-memory facts of this machine: granularity, and a reserve/commit round trip."""
    from extkv import ExtensibleTensor

    probe = ExtensibleTensor(0, args.device)  # reserves exactly one granule
    granularity = probe.capacity_bytes
    probe.free()
    buf = ExtensibleTensor(args.reserve_gib << 30, args.device)
    buf.resize_(min(64 << 20, buf.capacity_bytes)).fill_(1)
    facts = {
        "device": str(buf.device),
        "granularity_bytes": granularity,
        "reserved_bytes": buf.capacity_bytes,
        "committed_bytes": buf.committed_bytes,
        "physical_allocations": buf.num_allocations,
        "base_ptr": hex(buf.base_ptr),
    }
    buf.free()
    print(json.dumps(facts, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="extkv", description=__doc__, formatter_class=formatter)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="run a tiny random model, legacy vs extensible", formatter_class=formatter
    )
    demo.add_argument("--prompt", action="append", help="repeatable")
    add_engine_args(demo)
    add_sampling_args(demo)
    demo.set_defaults(func=cmd_demo, max_tokens=16)

    gen = sub.add_parser(
        "generate", help="generate from a checkpoint folder", formatter_class=formatter
    )
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser(
        "info", help="virtual-memory facts of this machine", formatter_class=formatter
    )
    info.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    info.add_argument("--reserve-gib", type=int, default=1)
    info.set_defaults(func=cmd_info)
    return parser


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
