"""The OpenAI server on CUDA with the default device: its engine thread must select the
device it was built on (a bare "cuda" once killed the engine as the server started)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from extkv import LLM
from extkv.demo import make_random_checkpoint
from live_server import MODEL, serving

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", with_tokenizer=False, dtype=torch.bfloat16
    )


@pytest.mark.parametrize("device", [None, "cuda"])
def test_server_on_the_default_cuda_device_answers(checkpoint: Path, device: str | None) -> None:
    llm = LLM(str(checkpoint), device=device, gpu_memory_utilization=0.1, max_model_len=256)
    assert llm.engine.config.device == torch.device("cuda", torch.cuda.current_device())
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
    with serving(llm) as url:
        response = httpx.post(
            f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60
        )
        assert response.status_code == 200, response.text
        assert httpx.get(f"{url}/health").status_code == 200  # the engine thread lives on
    assert response.json()["usage"]["completion_tokens"] == 8
    llm.close()
