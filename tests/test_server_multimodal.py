"""The server's chat endpoint with images, as vLLM's: OpenAI image_url content parts (data:
URLs, file:// URLs inside --allowed-local-media-path), --limit-mm-per-prompt, the same
tokens as LLM.chat, bad images a 400 naming `messages` with nothing leaked, and the
encoder cache's hits and misses in /metrics."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extkv import LLM, SamplingParams
from extkv.demo import IMAGE_TOKEN, make_random_gemma3, make_random_llava
from helpers import image, png_data_url
from live_server import ENGINE, MODEL, Server, running

GREEDY = dict(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    image(2).save(folder / "two.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return folder


@pytest.fixture(scope="module")
def vlm_server(
    llava: Path, media: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("logs")
    flags = ["--limit-mm-per-prompt=image=2", f"--allowed-local-media-path={media}"]
    with running(Server(llava, logs / "vlm.log", *flags)) as (server,):
        yield server


@pytest.fixture(scope="module")
def vlm_reference(llava: Path, media: Path) -> LLM:
    return LLM(llava, device="cpu", allowed_local_media_path=str(media), **ENGINE)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def chat(server: Server, messages: list[dict], **body: object) -> httpx.Response:
    payload = {"model": MODEL, "messages": messages, **GREEDY, "return_token_ids": True, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)


def test_chat_with_images_equals_llm_chat(
    vlm_server: Server, vlm_reference: LLM, media: Path
) -> None:
    messages = user(
        {"type": "text", "text": "What are these?"},
        image_part(png_data_url(image(1))),
        image_part(f"file://{media}/two.png"),
    )
    [want] = vlm_reference.chat(messages, SamplingParams(**GREEDY), use_tqdm=False)
    response = chat(vlm_server, messages)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == want.outputs[0].token_ids
    assert choice["prompt_token_ids"] == want.prompt_token_ids
    assert response.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    # Through the openai client, streamed: the same text.
    stream = vlm_server.client().chat.completions.create(
        model=MODEL, messages=messages, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.outputs[0].text


def test_repeated_images_hit_the_encoder_cache(vlm_server: Server) -> None:
    before = vlm_server.wait_idle()
    assert before["extkv_encoder_cache_tokens"] > 0
    picture = png_data_url(image(21))
    for text in ("first look", "second look"):
        messages = user(image_part(picture), {"type": "text", "text": text})
        assert chat(vlm_server, messages).status_code == 200
    after = vlm_server.wait_idle()
    assert after["extkv_encoder_cache_misses"] == before["extkv_encoder_cache_misses"] + 1
    assert after["extkv_encoder_cache_hits"] == before["extkv_encoder_cache_hits"] + 1
    assert 0 < after["extkv_encoder_cache_used_tokens"] <= after["extkv_encoder_cache_tokens"]


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (
            [image_part("data:image/png;base64," + base64.b64encode(b"junk").decode())],
            "not an image",
        ),
        ([image_part("file://{media}/broken.png")], "not an image"),
        (
            [image_part("https://example.com/cat.png")],
            "remote image URLs are fetched only from the hosts",
        ),
        ([image_part("file:///etc/hostname")], "outside --allowed-local-media-path"),
        ([image_part("file://{media}/missing.png")], "cannot read"),
        ([image_part(png_data_url(image(1)))] * 3, "limit_mm_per_prompt={'image': 2}"),
        (
            [{"type": "text", "text": f"typed {IMAGE_TOKEN} placeholder"}],
            "image placeholder token",
        ),
        ([{"type": "image_url", "image_url": {}}], "content"),
        ([{"type": "video_url", "video_url": {"url": "x"}}], "content"),
    ],
)
def test_bad_images_are_a_400_naming_messages(
    vlm_server: Server, media: Path, parts: list[dict], message: str
) -> None:
    before = vlm_server.wait_idle()
    parts = [
        {**p, "image_url": {"url": p["image_url"]["url"].format(media=media)}}
        if p.get("image_url", {}).get("url")
        else p
        for p in parts
    ]
    response = chat(vlm_server, user({"type": "text", "text": "look"}, *parts))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and message in error["message"]
    after = vlm_server.wait_idle()
    assert after["extkv_kv_cache_blocks_used"] == 0
    for name in ("used_tokens", "hits", "misses"):
        key = f"extkv_encoder_cache_{name}"
        assert after[key] == before[key]
    assert chat(vlm_server, user({"type": "text", "text": "still fine"})).status_code == 200


def test_a_placeholder_in_a_completion_prompt_is_a_400(vlm_server: Server) -> None:
    response = httpx.post(
        f"{vlm_server.url}/v1/completions",
        json={"model": MODEL, "prompt": f"see {IMAGE_TOKEN}", "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert "image placeholder" in response.json()["error"]["message"]


def test_tokenize_counts_the_image_positions(vlm_server: Server, vlm_reference: LLM) -> None:
    messages = user(image_part(png_data_url(image(1))), {"type": "text", "text": "hi"})
    [want] = vlm_reference.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    response = httpx.post(
        f"{vlm_server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == want.prompt_token_ids


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_gemma3(tmp_path_factory.mktemp("gemma3_vl"))


@pytest.fixture(scope="module")
def gemma3_server(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("logs")
    with running(Server(gemma3, logs / "gemma3.log")) as (server,):
        yield server


def test_gemma3_chat_with_images_equals_llm_chat(gemma3_server: Server, gemma3: Path) -> None:
    """Gemma 3 through its chat template (`<start_of_image>` per image part, expanded as
    its processor does): the tokens of LLM.chat; a `<start_of_image>` typed without an
    image a 400."""
    messages = user(
        {"type": "text", "text": "Describe"},
        image_part(png_data_url(image(1))),
        {"type": "text", "text": "then"},
        image_part(png_data_url(image(2))),
    )
    reference = LLM(gemma3, device="cpu", **ENGINE)
    [want] = reference.chat(messages, SamplingParams(**GREEDY), use_tqdm=False)
    response = chat(gemma3_server, messages)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == want.outputs[0].token_ids
    assert choice["prompt_token_ids"] == want.prompt_token_ids
    typed = chat(gemma3_server, user({"type": "text", "text": "see <start_of_image>"}))
    assert typed.status_code == 400
    assert "1 image placeholder token(s)" in typed.json()["error"]["message"]
    assert gemma3_server.wait_idle()["extkv_kv_cache_blocks_used"] == 0


def test_a_text_model_refuses_image_parts(server: Server) -> None:
    before = server.wait_idle()
    response = chat(server, user(image_part(png_data_url(image(1)))))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "takes no images" in error["message"]
    assert server.wait_idle()["extkv_kv_cache_blocks_used"] == before["extkv_kv_cache_blocks_used"]
    assert server.metrics()["extkv_encoder_cache_tokens"] == 0
