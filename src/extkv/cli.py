"""The `extkv` command: demo, generate, bench, serve, info."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import NoReturn

from extkv.engine.config import EngineConfig
from extkv.engine.errors import StartupError
from extkv.engine.sampling_params import SamplingParams
from extkv.options import Choice, add_options, options_from

logger = logging.getLogger("extkv")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# The command line generates greedily unless told otherwise.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 32}


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """Every `LLM(...)` option as a flag, with its default and allowed values."""
    skip = () if with_model else ("model",)
    add_options(parser.add_argument_group("engine"), EngineConfig, skip=skip)


def engine_config(args: argparse.Namespace, **changes: object) -> EngineConfig:
    """The engine options of the command line, checked before anything is loaded."""
    return EngineConfig(**(options_from(args, EngineConfig) | changes))


def add_sampling_args(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """Every SamplingParams field as a flag; the command line defaults to greedy, 32 tokens,
    and a command may change a default (its --help then shows that one)."""
    group = parser.add_argument_group("sampling")
    add_options(group, SamplingParams, defaults=CLI_SAMPLING_DEFAULTS | defaults)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as the one SamplingParams that every prompt shares."""
    return SamplingParams(**options_from(args, SamplingParams))


def _generate(
    args: argparse.Namespace, config: EngineConfig, prompts: list[str], chat: bool = False
) -> list:
    from extkv import LLM

    llm = LLM.from_config(config)
    if chat:  # each prompt is one user message, through the model's chat template
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, sampling_params(args))
    else:
        outputs = llm.generate(prompts, sampling_params(args))
    for out in outputs:
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    report = llm.memory_report()
    print(json.dumps(report, indent=1, default=str))
    llm.close()
    return [o.outputs[0].token_ids for o in outputs]


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from a checkpoint folder: print each prompt's completion, then the memory report."""
    _generate(args, engine_config(args), args.prompt, chat=args.chat)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Offline throughput: `--num-prompts` random prompts of `--input-len` tokens,
    submitted at once, each generating `--max-tokens` tokens."""
    import torch

    from extkv import LLM

    config, params = engine_config(args), sampling_params(args)
    llm = LLM.from_config(config)
    shape = (args.num_prompts, args.input_len)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, llm.engine.vocab_size, shape, generator=generator).tolist()
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
    """Serve the model over HTTP (OpenAI API) until SIGTERM/SIGINT (exit 0) or until the
    engine dies (exit 1, for a supervisor to restart it); the KV cache is freed either way."""
    from extkv import LLM
    from extkv.serving import ServerSettings, run_server

    config = engine_config(args)
    values = options_from(args, ServerSettings)
    values["model_name"] = values["model_name"] or config.model
    values["api_key"] = values["api_key"] or os.environ.get("EXTKV_API_KEY")
    settings = ServerSettings(**values)
    llm = LLM.from_config(config)
    try:
        return run_server(llm.engine, settings, args.log_level)
    finally:
        llm.close()


def cmd_demo(args: argparse.Namespace) -> int:
    """Build the tiny checkpoint, generate with the legacy and the extensible KV cache,
    and check that both give the same tokens."""
    from extkv.demo import demo_checkpoint

    args.ignore_eos = True
    folder = str(demo_checkpoint())
    prompts = args.prompt or ["The extensible KV cache", "Once upon a time", "CUDA graphs"]
    results = {}
    for extensible in (False, True):
        print(f"--- {'extensible' if extensible else 'legacy'} KV cache")
        config = engine_config(args, model=folder, enable_extensible_kv_cache=extensible)
        results[extensible] = _generate(args, config, prompts)
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The epilog keeps its line breaks."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, before anything is loaded."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _engine_options_help() -> str:
    """The engine options and their defaults, so that `extkv --help` shows them all."""
    parser = _Parser(add_help=False, usage=argparse.SUPPRESS, formatter_class=_HelpFormatter)
    add_engine_args(parser, with_model=False)
    options = parser.format_help().lstrip().split("\n", 1)[1]  # without the group's title
    return "engine options of demo, generate, bench and serve:\n" + options


def build_parser() -> argparse.ArgumentParser:
    """The `extkv` parser; engine, sampling and server flags come from their option classes, so
    they cannot drift from the Python API."""
    formatter = _HelpFormatter
    parser = _Parser(
        prog="extkv", description=__doc__, epilog=_engine_options_help(), formatter_class=formatter
    )
    parser.add_argument(
        "--log-level",
        default="info",
        type=_log_level,
        help=f"logging level ({', '.join(LOG_LEVELS)}; default: info)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser(
        "demo", help="run a tiny random model, legacy vs extensible", formatter_class=formatter
    )
    demo.add_argument("--prompt", action="append", help="repeatable")
    add_engine_args(demo, with_model=False)
    add_sampling_args(demo, max_tokens=16)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser(
        "generate", help="generate from a checkpoint folder", formatter_class=formatter
    )
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the model's chat template "
        "(default: off, the prompt is the raw text)",
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser(
        "bench", help="offline throughput on random prompts", formatter_class=formatter
    )
    bench.add_argument("--num-prompts", type=int, default=64, help="prompts submitted at once")
    bench.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    add_engine_args(bench)
    add_sampling_args(bench, max_tokens=128, ignore_eos=True)
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server", formatter_class=formatter
    )
    from extkv.serving.settings import ServerSettings

    add_options(serve.add_argument_group("server"), ServerSettings, defaults={"model_name": None})
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    info = sub.add_parser(
        "info", help="virtual-memory facts of this machine", formatter_class=formatter
    )
    info.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
    info.add_argument("--reserve-gib", type=int, default=1)
    info.set_defaults(func=cmd_info)
    return parser


def _log_level(text: str) -> str:
    level = Choice(LOG_LEVELS).parse(text)
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}; got {text!r}")
    return level


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; bad options and failed start-ups log one error line and exit 2,
    not a traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, StartupError) as e:
        logger.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
