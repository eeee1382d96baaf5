"""The `extkv` command: demo, generate, bench, serve, info."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

from extkv.engine.config import DEFAULT_CPU_MEMORY_BUDGET, ENGINE_BACKENDS, EngineConfig

logger = logging.getLogger("extkv")


def _extensible(value: str) -> bool | str:
    choices = {"true": True, "false": False, "auto": "auto"}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected true, false or auto; got {value!r}")
    return choices[value.lower()]


def _on_off(value: str) -> bool:
    choices = {"true": True, "on": True, "false": False, "off": False}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected true or false; got {value!r}")
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
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use"
    )
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="legacy path only")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="fix the block count")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in a batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 8192")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--attention-backend", choices=ENGINE_BACKENDS, default="split", help="KV cache layout"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    g.add_argument(
        "--cpu-memory-budget-bytes",
        type=int,
        default=DEFAULT_CPU_MEMORY_BUDGET,
        help="memory the engine may use on the CPU",
    )
    g.add_argument(
        "--kv-cache-margin-bytes",
        type=int,
        default=None,
        help="memory the extensible sizing keeps free (default: 256 MiB on CUDA)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks to split the model over (worker processes; one GPU each on CUDA)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV of prompt prefixes already computed",
    )
    g.add_argument(
        "--async-scheduling",
        type=_on_off,
        default=None,
        help="plan each step while the device runs the one before (true or false; "
        "default: true unless --tensor-parallel-size > 1)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"
    }


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of every request")
    g.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")


def _sampling_params(args: argparse.Namespace):  # -> SamplingParams
    from extkv import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )


def _generate(args: argparse.Namespace, model: str, prompts: list[str]) -> list:
    from extkv import LLM

    llm = LLM(model, **engine_kwargs(args))
    outputs = llm.generate(prompts, _sampling_params(args))
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    report = llm.memory_report()
    print(json.dumps(report, indent=1, default=str))
    return [o.outputs[0].token_ids for o in outputs]


def cmd_generate(args: argparse.Namespace) -> int:
    _generate(args, args.model, args.prompt)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Offline throughput: `--num-prompts` random prompts of `--input-len` tokens,
    submitted at once, each generating `--max-tokens` tokens."""
    import torch

    from extkv import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    shape = (args.num_prompts, args.input_len)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, llm.engine.vocab_size, shape, generator=generator).tolist()
    params = _sampling_params(args)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    llm.close()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_tokens": generated,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(args.num_prompts / elapsed, 2),
        "output_tokens_per_s": round(generated / elapsed, 1),
        "total_tokens_per_s": round((generated + args.num_prompts * args.input_len) / elapsed, 1),
    }
    print(json.dumps(result, indent=1))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the model over HTTP (OpenAI API) until interrupted."""
    from extkv import LLM
    from extkv.serving import ServerSettings, run_server

    settings = ServerSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or os.environ.get("EXTKV_API_KEY"),
        max_pending_requests=args.max_pending_requests,
        max_request_bytes=args.max_request_bytes,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    try:
        run_server(llm.engine, settings, args.host, args.port, args.log_level)
    finally:
        llm.close()
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
    from extkv.vmm import allocation_granularity

    granularity = allocation_granularity(args.device)
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help; the epilog keeps its line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        return help if "default:" in help else super()._get_help_string(action)


def _engine_options_help() -> str:
    """The engine options and their defaults, so that `extkv --help` shows them all."""
    parser = argparse.ArgumentParser(
        add_help=False, usage=argparse.SUPPRESS, formatter_class=_HelpFormatter
    )
    add_engine_args(parser)
    options = parser.format_help().lstrip().split("\n", 1)[1]  # without the group's title
    return "engine options of demo, generate, bench and serve:\n" + options


def build_parser() -> argparse.ArgumentParser:
    formatter = _HelpFormatter
    parser = argparse.ArgumentParser(
        prog="extkv", description=__doc__, epilog=_engine_options_help(), formatter_class=formatter
    )
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

    bench = sub.add_parser(
        "bench", help="offline throughput on random prompts", formatter_class=formatter
    )
    bench.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    bench.add_argument("--num-prompts", type=int, default=64, help="prompts submitted at once")
    bench.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    add_engine_args(bench)
    add_sampling_args(bench)
    bench.set_defaults(func=cmd_bench, max_tokens=128, ignore_eos=True)

    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server", formatter_class=formatter
    )
    serve.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 = all")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 (default: $EXTKV_API_KEY, else none)",
    )
    serve.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="requests held at once, running or queued; beyond it: 429",
    )
    serve.add_argument(
        "--max-request-bytes", type=int, default=4 << 20, help="largest request body; beyond: 413"
    )
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

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
