"""The OpenAI server on CUDA with the default device: its engine thread must select the
device it was built on (a bare "cuda" once killed the engine as the server started)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from extkv import LLM
from extkv.demo import make_random_checkpoint
from extkv.serving import ServerSettings, build_app
from live_server import free_port

pytestmark = pytest.mark.gpu
MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", with_tokenizer=False, dtype=torch.bfloat16
    )


@pytest.mark.parametrize("device", [None, "cuda"])
def test_server_on_the_default_cuda_device_answers(checkpoint: Path, device: str | None) -> None:
    llm = LLM(str(checkpoint), device=device, gpu_memory_utilization=0.1, max_model_len=256)
    assert llm.engine.config.device == torch.device("cuda", torch.cuda.current_device())
    app = build_app(llm.engine, ServerSettings(MODEL))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={**body, "ignore_eos": True}, timeout=60
        )
        assert response.status_code == 200, response.text
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert response.json()["usage"]["completion_tokens"] == 8
    llm.close()
