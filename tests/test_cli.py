"""The command line: every flag is checked before a model is loaded, and what goes wrong
is one line that says what to pass (not a traceback after a minute of loading)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CPU = ["--device=cpu", "--max-model-len=256"]


def extkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "extkv.cli", *args], capture_output=True, text=True, timeout=timeout
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
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("INFO")]
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
