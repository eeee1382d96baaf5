"""`extkv serve` end to end on the CPU: real servers on loopback, real HTTP, the official
openai client. Tokens equal `LLM.generate`; 100 concurrent streams come back whole and
unmixed; a client that leaves frees its blocks; a full server answers 429, a wrong key
401, and malformed requests a clear 4xx while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from extkv import LLM, SamplingParams
from extkv.cli import main
from extkv.demo import make_random_checkpoint
from extkv.engine.config import EngineConfig
from extkv.serving.async_engine import GIL_SWITCH_INTERVAL_S
from extkv.serving.prompts import PromptEncoder
from helpers import children
from live_server import (
    CHAT_TEMPLATE_FILE,
    ENGINE,
    ENGINE_FLAGS,
    KEY,
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    Server,
    serving,
)

GREEDY = dict(temperature=0, max_tokens=16)
NO_EOS = {"ignore_eos": True, "return_token_ids": True}
JSON = {"Content-Type": "application/json"}


def expected(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def test_completion_matches_generate(server: Server, reference: LLM) -> None:
    client = server.client()
    want = expected(reference, [PROMPT], [SamplingParams(**GREEDY, ignore_eos=True)])[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, extra_body=NO_EOS)
    choice = got.choices[0]
    assert choice.token_ids == want.token_ids and choice.text == want.text
    assert choice.finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(PROMPT), 16)

    text = "Once upon a time"
    want = reference.generate([text], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=text, **GREEDY)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason


def test_default_max_tokens_fits_the_room_left(server: Server) -> None:
    """No max_tokens given: OpenAI's 16, cut to what max_model_len leaves after the prompt."""
    client = server.client()
    prompt = [5] * (MAX_MODEL_LEN - 4)
    got = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body=NO_EOS)
    assert got.usage.completion_tokens == 4
    assert got.choices[0].finish_reason == "length"


def test_chat_completion_matches_llm_chat(server: Server, reference: LLM) -> None:
    """Through the --chat-template file, which wins over the checkpoint's own template."""
    messages = [
        {"role": "system", "content": "You are tiny."},
        {"role": "user", "content": "Tell me about the KV cache."},
    ]
    params = SamplingParams(**GREEDY, ignore_eos=True)
    [want] = reference.chat(messages, params, chat_template=CHAT_TEMPLATE_FILE, use_tqdm=False)
    [own] = reference.chat(messages, params, use_tqdm=False)
    assert own.prompt_token_ids != want.prompt_token_ids  # the two templates differ
    got = server.client().chat.completions.create(
        model=MODEL, messages=messages, **GREEDY, extra_body=NO_EOS
    )
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.outputs[0].text
    assert choice.token_ids == want.outputs[0].token_ids
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


STREAM = dict(**GREEDY, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS)


def check_stream(chunks: list, texts: list[str], text: str, token_ids: list[int]) -> None:
    """Chunks (one per token, but a token that ends inside a character joins the next)
    that add up to the answer, none without text, then the usage chunk."""
    assert 0 < len(texts) <= 16 and all(texts) and "".join(texts) == text
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1


def test_streaming_matches_generate(server: Server, reference: LLM) -> None:
    want = expected(reference, [PROMPT], [SamplingParams(**GREEDY, ignore_eos=True)])[0]
    chunks = list(server.client().completions.create(model=MODEL, prompt=PROMPT, **STREAM))
    texts = [c.choices[0].text for c in chunks if c.choices]
    check_stream(chunks, texts, want.text, want.token_ids)


def test_chat_streaming_matches_non_streaming(server: Server) -> None:
    create = server.client().chat.completions.create
    messages = [{"role": "user", "content": "Stream, please."}]
    whole = create(model=MODEL, messages=messages, **GREEDY, extra_body=NO_EOS).choices[0]
    chunks = list(create(model=MODEL, messages=messages, **STREAM))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices]
    check_stream(chunks, texts, whole.message.content, whole.token_ids)


def test_stop_strings_and_stop_token_ids(server: Server, reference: LLM) -> None:
    client = server.client()
    params = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40)
    full = expected(reference, [PROMPT], [SamplingParams(temperature=0, max_tokens=40)])[0]
    stop = full.text[12:15]
    cut = full.text[: full.text.index(stop)]
    whole = client.completions.create(**params, stop=[stop, "never-there"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**params, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut  # nothing of `stop` leaks

    token = full.token_ids[5]
    cut_ids = full.token_ids[: full.token_ids.index(token) + 1]
    stopped = client.completions.create(
        **params, extra_body={"stop_token_ids": [token], "return_token_ids": True}
    )
    assert stopped.choices[0].token_ids == cut_ids
    assert stopped.choices[0].finish_reason == "stop"


def test_seeded_sampling_matches_generate(server: Server, reference: LLM) -> None:
    sampling = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=24)
    extensions = {"top_k": 50, "min_p": 0.2}
    want = expected(reference, [PROMPT], [SamplingParams(**sampling, **extensions)])[0]
    without_min_p = SamplingParams(**sampling, top_k=50)
    assert expected(reference, [PROMPT], [without_min_p])[0].token_ids != want.token_ids
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPT, **sampling, extra_body={**extensions, "return_token_ids": True}
    )
    assert got.choices[0].token_ids == want.token_ids


def test_100_concurrent_streams(server: Server, reference: LLM) -> None:
    prompts = [[(7 * i + j) % 380 + 3 for j in range(1 + i % 37)] for i in range(100)]
    lengths = [1 + i % 8 for i in range(100)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    want = [o.token_ids for o in expected(reference, prompts, params)]
    before = server.metrics()

    async def stream(client: openai.AsyncOpenAI, prompt: list[int], n: int) -> list[int]:
        chunks = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body=NO_EOS
        )
        return [t async for c in chunks for t in c.choices[0].token_ids]

    async def run() -> list[list[int]]:
        url = f"{server.url}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
            return await asyncio.gather(*map(stream, [client] * 100, prompts, lengths))

    assert asyncio.run(asyncio.wait_for(run(), 60)) == want
    after = server.wait_idle()
    assert after["extkv_kv_cache_blocks_used"] == 0
    assert after["extkv_requests_running"] == after["extkv_requests_waiting"] == 0
    assert after["extkv_kv_cache_blocks"] > 0
    generated = after["extkv_generation_tokens_total"] - before["extkv_generation_tokens_total"]
    assert generated == sum(lengths)
    ttft = "extkv_time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == 100


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_blocks(server: Server, stream: bool) -> None:
    aborts = "extkv_requests_finished_total{reason=abort}"
    before = server.metrics().get(aborts, 0)
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=1000, ignore_eos=True, stream=stream)
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # it is generating; now leave
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.2)
    after = server.wait_idle()
    assert after.get(aborts, 0) == before + 1
    assert after["extkv_kv_cache_blocks_used"] == 0


def test_full_server_answers_429(guarded: Server) -> None:
    client = guarded.client(KEY)
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=1000, extra_body={"ignore_eos": True})
    with client.completions.create(**body, stream=True) as first:
        next(iter(first))  # admitted and generating: the one slot is taken
        with pytest.raises(openai.RateLimitError, match="max-pending-requests=1"):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    deadline = time.monotonic() + 10  # the slot comes back once the abort is through
    while True:
        try:
            assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_api_key(guarded: Server) -> None:
    for key in ("none", "wrong-key"):
        with pytest.raises(openai.AuthenticationError, match="API key"):
            guarded.client(key).models.list()
    assert httpx.get(f"{guarded.url}/v1/models").status_code == 401  # no header at all
    assert [m.id for m in guarded.client(KEY).models.list()] == [MODEL]
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_chat_without_template_is_400(guarded: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        guarded.client(KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )


def test_engine_failure_is_503_not_a_hang(checkpoints: tuple[Path, Path]) -> None:
    """A step that raises fails its requests and every later one; /health says so."""
    llm = LLM(checkpoints[1], device="cpu", **ENGINE)

    def broken_step() -> list:
        raise RuntimeError("boom")

    llm.engine.step = broken_step
    with serving(llm, bare=True, max_pending_requests=8, max_request_bytes=1024) as url:
        body = {"model": MODEL, "prompt": [1, 2, 3]}
        for stream in (False, True, False):
            response = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream})
            assert response.status_code == 503 and "boom" in response.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503


def test_a_model_without_tokenizer_streams_a_chunk_per_token(tmp_path: Path) -> None:
    """Token ids in, token ids out: with no text to hold back, every step's token is a
    chunk of its own (held to the end, a benchmark saw no inter-token latency at all)."""
    model = make_random_checkpoint(tmp_path / "model", with_tokenizer=False)
    llm = LLM(model, device="cpu", **ENGINE)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, **NO_EOS}
    with serving(llm) as url:
        # The engine thread hands the GIL over within a fraction of a step: no bursts.
        assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S
        whole = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
        events = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}).text
    chunks = [
        json.loads(line[6:])["choices"][0]
        for line in events.splitlines()
        if line.startswith("data: {")
    ]
    assert [c["token_ids"] for c in chunks] == [[t] for t in whole["token_ids"]]
    assert len(whole["token_ids"]) == 6 and chunks[-1]["finish_reason"] == "length"
    llm.close()


def test_closing_the_prompt_encoder_ends_and_reaps_its_processes(reference: LLM) -> None:
    """An in-process server (as above) leaves no tokenizer process behind, not even a
    zombie: close() ends the workers, busy or not, and waits for them."""

    def spawned() -> set[int]:
        return {pid for pid, cmdline in children().items() if b"spawn_main" in cmdline}

    before = spawned()
    encoder = PromptEncoder(reference.get_tokenizer(), MODEL, MAX_MODEL_LEN)
    assert asyncio.run(encoder.encode("hello", "prompt"))
    workers = spawned() - before
    assert workers
    encoder.close()
    assert not workers & spawned()


def _completion(**changes: object) -> dict[str, object]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


def _chat(**changes: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **changes}


CHAT = "/v1/chat/completions"
BAD_REQUESTS = [
    # (path, JSON body or raw bytes, status, words the message must hold)
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, "object"),
    ("/v1/completions", b"", 400, "JSON"),
    ("/v1/completions", _completion(prompt=None), 400, "prompt: Field required"),
    ("/v1/completions", _completion(model="gpt-9"), 404, "'gpt-9' does not exist"),
    ("/v1/completions", _completion(temperature=-1), 400, "temperature"),
    ("/v1/completions", _completion(temperature="hot"), 400, "temperature"),
    ("/v1/completions", _completion(top_p=0), 400, "top_p"),
    ("/v1/completions", _completion(top_k=-2), 400, "top_k must be an int in [-1, 2**63)"),
    ("/v1/completions", _completion(top_k=2**63), 400, "top_k"),
    ("/v1/completions", _completion(min_p=1.5), 400, "min_p"),
    ("/v1/completions", _completion(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", _completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens=1024"),
    ("/v1/completions", _completion(prompt=[1] * MAX_MODEL_LEN), 400, "max_model_len=1024"),
    ("/v1/completions", _completion(prompt=[999_999]), 400, "vocabulary"),
    ("/v1/completions", _completion(prompt=""), 400, "empty"),
    ("/v1/completions", _completion(prompt=["a", 1]), 400, "list of token ids"),
    ("/v1/completions", _completion(prompt=[[1], "a"]), 400, "list of such lists"),
    ("/v1/completions", _completion(prompt=[1, True]), 400, "list of token ids"),
    ("/v1/completions", _completion(n=0), 400, "n: Input should be greater than or equal to 1"),
    ("/v1/completions", _completion(n=2000), 400, "n: this request asks for 2000 choices"),
    ("/v1/completions", _completion(stream_options={}), 400, "allowed only with stream=true"),
    ("/v1/completions", _completion(logprobz=5), 400, "logprobz: unknown field"),
    ("/v1/completions", _completion(stream="yes"), 400, "stream"),
    ("/v1/completions", _completion(stop=5), 400, "stop: must be"),
    ("/v1/completions", _completion(stop=[""]), 400, "stop: must be"),
    ("/v1/completions", _completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("/v1/completions", _completion(seed=1.5), 400, "seed"),
    ("/v1/completions", _completion(prompt="x" * 70_000), 413, "bytes"),
    (CHAT, _chat(messages=[]), 400, "messages"),
    (CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    (CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "content: must be"),
    (CHAT, _chat(messages=[{"role": "user"}]), 400, "content: Field required"),
    ("/v1/nothing", _completion(), 404, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "words"), BAD_REQUESTS)
def test_bad_request_gets_clear_4xx(
    server: Server, path: str, body: dict | bytes, status: int, words: str
) -> None:
    if isinstance(body, bytes):
        response = httpx.post(server.url + path, content=body, headers=JSON)
    else:
        response = httpx.post(server.url + path, json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/models").status_code == 200  # still serving


def test_help_lists_every_engine_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for field in EngineConfig.__dataclass_fields__:
        if field != "model":
            assert f"--{field.replace('_', '-')}" in text
    assert "default: 16)" in text  # --block-size


def test_bench_reports_throughput(checkpoints: tuple[Path, Path], capsys) -> None:
    flags = [f"--model={checkpoints[1]}", "--num-prompts=4", "--input-len=8", "--max-tokens=4"]
    assert main(["bench", *flags, *ENGINE_FLAGS]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["output_tokens"] == 16 and result["output_tokens_per_s"] > 0
