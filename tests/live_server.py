"""A live `extkv serve` for the server tests: a subprocess on a free loopback port, the
settings every server test shares, and reading its metrics."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from extkv import LLM
from extkv.serving import ServerSettings, build_app
from extkv.serving.app import make_server

MODEL = "tiny"
MAX_MODEL_LEN = 1024
ENGINE = dict(
    cpu_memory_budget_bytes=256 << 20, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512
)
ENGINE_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()] + ["--device=cpu"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The open server's --chat-template, in place of the checkpoint's CHAT_TEMPLATE.
CHAT_TEMPLATE_FILE = (
    "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:{% endif %}"
)
PROMPT = [5, 6, 7, 8, 9, 100, 200]
KEY = "test-key"  # the guarded server's API key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`extkv serve` in a subprocess on a free loopback port; its log goes to a file."""

    def __init__(self, checkpoint: Path, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "extkv.cli", "serve", f"--model={checkpoint}"]
        command += [f"--port={self.port}", f"--served-model-name={MODEL}", *ENGINE_FLAGS, *flags]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def client(self, api_key: str = "none", **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample, keyed by name plus labels (e.g. `x_total{reason=abort}`)."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return samples

    def wait_idle(self, timeout: float = 10) -> dict[str, float]:
        """Metrics once no request holds blocks (the last step's gauges may lag a little)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["extkv_requests_running"] == m["extkv_requests_waiting"] == 0
            if (idle and m["extkv_kv_cache_blocks_used"] == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@contextmanager
def running(*servers: Server) -> Iterator[tuple[Server, ...]]:
    """`servers` (already launched, so they start together) once all are ready; each
    stopped on the way out, whatever happened."""
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextmanager
def serving(llm: LLM, bare: bool = False, **settings: object) -> Iterator[str]:
    """`llm` served by `make_server` on a thread of this process (its engine may be
    patched); yields the base URL. `bare`: the app under a plain uvicorn server instead,
    which keeps answering once the engine died (make_server's stops then)."""
    options = ServerSettings(MODEL, port=free_port(), **settings)
    if bare:
        config = uvicorn.Config(build_app(llm.engine, options), port=options.port, log_config=None)
        server = uvicorn.Server(config)
    else:
        server = make_server(llm.engine, options)
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()
