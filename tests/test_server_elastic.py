"""Elastic memory through a live `extkv serve`: /sleep, /wake_up and /is_sleeping as vLLM
has them (only with --enable-sleep-mode), /kv_cache and /kv_cache/resize, the resize
counts in /metrics, and a clear 4xx for every bad parameter."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from live_server import MAX_MODEL_LEN, MODEL, PROMPT, Server, running

MIN_BLOCKS = MAX_MODEL_LEN // 16
GREEDY = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 8}
NO_EOS = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def elastic(
    checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("elastic") / "server.log"
    flags = ("--enable-extensible-kv-cache", "--enable-sleep-mode")
    with running(Server(checkpoints[1], log, *flags)) as (server,):
        yield server


def tokens(server: Server, **changes: object) -> list[int]:
    response = httpx.post(f"{server.url}/v1/completions", json={**GREEDY, **NO_EOS, **changes})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def post(server: Server, path: str, **kwargs: object) -> httpx.Response:
    return httpx.post(server.url + path, timeout=60, **kwargs)


def metric_becomes(server: Server, name: str, value: float) -> None:
    """The engine thread updates the gauges right after a call: wait a moment for it."""
    deadline = time.monotonic() + 10
    while server.metrics().get(name) != value:
        assert time.monotonic() < deadline, f"{name} = {server.metrics().get(name)}, not {value}"
        time.sleep(0.05)


def test_sleep_and_wake_over_http(elastic: Server) -> None:
    before = tokens(elastic)
    assert httpx.get(f"{elastic.url}/is_sleeping").json() == {"is_sleeping": False}
    response = post(elastic, "/sleep?level=2")
    assert response.status_code == 200 and response.json() == {"is_sleeping": True, "level": 2}
    assert httpx.get(f"{elastic.url}/is_sleeping").json() == {"is_sleeping": True}
    asleep = httpx.post(f"{elastic.url}/v1/completions", json=GREEDY)
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    metric_becomes(elastic, "extkv_sleep_level", 2)
    assert post(elastic, "/wake_up?tags=weights").json() == {"is_sleeping": True}
    assert post(elastic, "/wake_up?tags=kv_cache&tags=weights").json() == {"is_sleeping": False}
    assert tokens(elastic) == before
    metric_becomes(elastic, "extkv_sleep_level", 0)


def test_sleep_refuses_running_requests_or_drains_them(elastic: Server) -> None:
    body = {**GREEDY, **NO_EOS, "max_tokens": 400, "stream": True}
    drained: dict[str, httpx.Response] = {}
    with httpx.stream("POST", f"{elastic.url}/v1/completions", json=body, timeout=60) as stream:
        lines = (line for line in stream.iter_lines() if line.startswith("data: "))
        next(lines)  # running now
        refused = post(elastic, "/sleep")
        assert refused.status_code == 409
        assert "in flight" in refused.json()["error"]["message"]
        drain = threading.Thread(target=lambda: drained.update(r=post(elastic, "/sleep?drain=1")))
        drain.start()
        rest = list(lines)
        drain.join(timeout=60)
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    assert drained["r"].status_code == 200
    assert httpx.get(f"{elastic.url}/is_sleeping").json() == {"is_sleeping": True}
    post(elastic, "/wake_up")


@pytest.mark.parametrize(
    ("query", "param", "message"),
    [
        ("/sleep?level=3", "level", "level must be one of 1, 2; got '3'"),
        ("/sleep?level=one", "level", "level must be one of 1, 2; got 'one'"),
        ("/sleep?drain=maybe", "drain", "drain must be True or False; got 'maybe'"),
        ("/wake_up?tags=gpu", "tags", "tags must be one of 'weights', 'kv_cache'; got 'gpu'"),
    ],
)
def test_bad_sleep_parameters_are_400(
    elastic: Server, query: str, param: str, message: str
) -> None:
    response = post(elastic, query)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (param, message)
    assert httpx.get(f"{elastic.url}/is_sleeping").json() == {"is_sleeping": False}


def test_resize_over_http(elastic: Server) -> None:
    before = tokens(elastic)
    status = httpx.get(f"{elastic.url}/kv_cache").json()
    assert status["extensible"] and status["num_blocks_used"] == 0
    assert status["policy"] == "static" and status["num_blocks_ceiling"] is None
    assert status["num_blocks"] <= status["num_blocks_capacity"]
    shrinks = status["num_resizes"]["shrink"]
    report = post(elastic, "/kv_cache/resize", json={"num_blocks": MIN_BLOCKS + 10}).json()
    assert report["num_blocks"] == MIN_BLOCKS + 10
    assert report["committed_bytes"] < report["previous_committed_bytes"]
    status = httpx.get(f"{elastic.url}/kv_cache").json()
    assert status["num_blocks"] == MIN_BLOCKS + 10
    assert status["committed_bytes"] == report["committed_bytes"]
    assert status["num_resizes"]["shrink"] == shrinks + 1
    metric_becomes(elastic, "extkv_kv_cache_blocks", MIN_BLOCKS + 10)
    metric_becomes(elastic, "extkv_kv_cache_resizes{direction=shrink}", shrinks + 1)
    assert tokens(elastic) == before
    grown = post(elastic, "/kv_cache/resize", json={"memory_bytes": 64 << 20}).json()
    assert grown["num_blocks"] > MIN_BLOCKS + 10 and grown["committed_bytes"] <= 64 << 20
    metric_becomes(elastic, "extkv_kv_cache_committed_bytes", grown["committed_bytes"])
    assert tokens(elastic) == before


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({}, 400, "give exactly one of num_blocks (an int >= 1) or memory_bytes"),
        ({"num_blocks": 80, "memory_bytes": 1 << 30}, 400, "give exactly one of"),
        ({"num_blocks": 0}, 400, "num_blocks: Input should be greater than or equal to 1"),
        ({"num_blocks": "80"}, 400, "num_blocks: Input should be a valid integer"),
        ({"memory_bytes": -1}, 400, "memory_bytes: Input should be greater than or equal to 0"),
        ({"blocks": 80}, 400, "blocks: unknown field; accepted fields: num_blocks, memory_bytes"),
        ({"num_blocks": 10}, 400, f"fewer than the {MIN_BLOCKS} blocks one sequence"),
        ({"num_blocks": 10**12}, 400, "more than the"),
    ],
)
def test_bad_resize_bodies_are_400(elastic: Server, body: dict, status: int, message: str) -> None:
    before = httpx.get(f"{elastic.url}/kv_cache").json()
    response = post(elastic, "/kv_cache/resize", json=body)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert httpx.get(f"{elastic.url}/kv_cache").json() == before


def test_without_sleep_mode_there_are_no_sleep_endpoints(server: Server) -> None:
    """The shared server: legacy KV cache, no --enable-sleep-mode."""
    assert post(server, "/sleep").status_code == 404
    assert post(server, "/wake_up").status_code == 404
    assert httpx.get(f"{server.url}/is_sleeping").status_code == 404
    assert httpx.get(f"{server.url}/kv_cache").json()["extensible"] is False
    response = post(server, "/kv_cache/resize", json={"num_blocks": MIN_BLOCKS})
    assert response.status_code == 409
    assert "needs the extensible KV cache" in response.json()["error"]["message"]


def test_the_elastic_policy_over_http(
    checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """/kv_cache shows the policy and its bounds; an idle server gives back, on its own
    after --kv-idle-release-s, what was grown past the floor."""
    log = tmp_path_factory.mktemp("policy") / "server.log"
    flags = ("--enable-extensible-kv-cache", "--kv-cache-policy=elastic", "--kv-idle-release-s=1")
    with running(Server(checkpoints[1], log, *flags)) as (server,):
        status = httpx.get(f"{server.url}/kv_cache").json()
        floor, ceiling = status["num_blocks_floor"], status["num_blocks_ceiling"]
        assert status["policy"] == "elastic" and status["idle_release_s"] == 1.0
        assert (
            MIN_BLOCKS <= floor == status["num_blocks"] < ceiling <= status["num_blocks_capacity"]
        )
        before = tokens(server)
        grown = post(server, "/kv_cache/resize", json={"num_blocks": ceiling}).json()
        assert grown["num_blocks"] == ceiling
        metric_becomes(server, "extkv_kv_cache_blocks", floor)  # idle for a second: given back
        metric_becomes(server, "extkv_kv_cache_resizes{direction=shrink}", 1)
        assert httpx.get(f"{server.url}/kv_cache").json()["num_blocks"] == floor
        assert tokens(server) == before
