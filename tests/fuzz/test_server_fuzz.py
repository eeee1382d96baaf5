"""Random JSON against a live `extkv serve`: both endpoints, streaming or not, with
extreme numbers (huge, negative, NaN and infinities, floats for ints), wrong types,
huge and odd unicode strings, deep nesting, unknown, empty and missing fields. Every
answer must be a 2xx or a 4xx (a stream never ends in a server error), the server must
still serve afterwards, and every KV block must be free again. The statuses seen are
logged (see them with `pytest -rP tests/fuzz`)."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extkv.demo import make_random_checkpoint
from live_server import CHAT_TEMPLATE, MODEL, Server

logger = logging.getLogger(__name__)
MAX_MODEL_LEN = 64  # so that any accepted max_tokens stays quick to generate

numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400]),
    st.floats(),  # NaN and the infinities too: json.dumps writes them as NaN, Infinity
    st.sampled_from([0.0, -0.0, 1.0, 1e-45, 1e-6, 2.0000001, 1e308, 5e-324]),
)
texts = st.one_of(
    st.text(max_size=50),
    st.text(st.characters(codec="utf-8"), max_size=20),
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\u202e\ufeff", "🙂" * 1000]),
    st.sampled_from(["x" * 200_000, "<|im_start|>" * 500, "\n" * 5000]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
token_ids = st.lists(st.one_of(st.integers(-5, 500), numbers, scalars), max_size=20)
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": texts | parts}
)
# Values per field: mostly plausible shapes with extreme values, sometimes anything.
FIELDS = {
    "model": st.one_of(st.just(MODEL), texts),
    "prompt": st.one_of(
        texts, token_ids, st.just([]), st.just([[1, 2]]), st.lists(texts, max_size=3)
    ),
    "messages": st.one_of(st.lists(message, max_size=3), st.just([])),
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "seed": numbers,
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": token_ids,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
    "user": texts,
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "logprobs": st.one_of(numbers, st.booleans()),
    "top_logprobs": numbers,
    "echo": st.booleans(),
    "n": st.one_of(numbers, st.integers(1, 3)),
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "min_tokens": numbers,
    "min_p": numbers,
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(texts, st.integers(0, 500).map(str)), numbers, max_size=3),
        anything,
    ),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """(path, body, stream): a valid base changed field by field, or anything at all."""
    chat = draw(st.booleans())
    stream = draw(st.booleans())
    base = {"model": MODEL, "max_tokens": 2, "stream": stream}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    changes = draw(st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=4))
    for name in changes:
        base[name] = draw(anything if draw(st.integers(0, 3)) == 0 else FIELDS[name])
    for name in draw(st.lists(st.sampled_from(sorted(base)), max_size=2)):
        base.pop(name, None)  # missing fields
    base |= draw(st.dictionaries(st.text(min_size=1, max_size=10), anything, max_size=2))
    body = draw(st.one_of(st.just(base), anything)) if draw(st.integers(0, 9)) == 0 else base
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return (
        path,
        json.dumps(body).encode(),
        body.get("stream") is True if isinstance(body, dict) else False,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = make_random_checkpoint(tmp_path_factory.mktemp("bare"))
    chat = Path(shutil.copytree(model, tmp_path_factory.mktemp("chat") / "model"))
    config = json.loads((chat / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    logs = tmp_path_factory.mktemp("logs")
    server = Server(chat, logs / "fuzz.log", f"--max-model-len={MAX_MODEL_LEN}")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_no_request_gets_a_5xx(
    server: Server, record_property, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=__name__)
    statuses: Counter[str] = Counter()
    client = httpx.Client(base_url=server.url, timeout=60)
    headers = {"Content-Type": "application/json"}

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests())
    def check(request: tuple[str, bytes, bool]) -> None:
        path, body, stream = request
        with client.stream("POST", path, content=body, headers=headers) as response:
            text = response.read().decode()
        assert response.status_code < 500, (body[:500], text[:500])
        statuses[f"{path} {'stream' if stream else 'whole'} {response.status_code}"] += 1
        if response.status_code == 200 and stream:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: {")]
            errors = [json.loads(e)["error"] for e in events if '"error"' in e[:10]]
            assert not [e for e in errors if e["code"] >= 500], (body[:500], errors)

    try:
        check()
    finally:
        logger.info("Statuses seen: %s", dict(sorted(statuses.items())))
        record_property("statuses", dict(sorted(statuses.items())))
        client.close()
    assert sum(n for key, n in statuses.items() if key.endswith(" 200")) > 0  # some got through
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.wait_idle()["extkv_kv_cache_blocks_used"] == 0
