"""Vision-language models end to end on the CPU: LLaVA's greedy tokens equal transformers'
(one image, two, a batch; CLIP and SigLIP towers; legacy and extensible KV caches), prompts
as text or token ids, the encoder cache (reused across prompt chunks, shared by content,
freed, counted), chat content parts, and bad input refused with nothing leaked."""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from extkv import LLM, SamplingParams
from extkv.demo import IMAGE_TOKEN, make_random_llava
from extkv.engine.errors import RequestFailedError
from helpers import (
    assert_encoder_cache_released,
    assert_no_request_or_image_held,
    hf_greedy_with_images,
    image,
    multimodal_prompts,
    png_data_url,
    tokens,
)

SMALL = dict(cpu_memory_budget_bytes=256 << 20, max_model_len=256, max_num_batched_tokens=512)
GREEDY = SamplingParams(temperature=0, max_tokens=10)
IMAGE_TOKENS = 16  # 28 x 28 pixels in 7 x 7 patches


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_llava(tmp_path_factory.mktemp("llava"), "llama", "clip")


@pytest.fixture(scope="module")
def llava_siglip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_llava(tmp_path_factory.mktemp("llava_siglip"), "qwen3", "siglip")


# (text, images): one image, two, none, the first image again with other text.
PROMPTS = [
    (f"USER: {IMAGE_TOKEN}\nWhat is this? ASSISTANT:", [image(1)]),
    (f"compare {IMAGE_TOKEN} and {IMAGE_TOKEN} please", [image(2), image(3, (20, 50))]),
    ("no picture here, just text", []),
    (f"{IMAGE_TOKEN} the quick brown fox", [image(1)]),
]


@pytest.mark.parametrize("extensible", [False, True])
@pytest.mark.parametrize("tower", ["llava", "llava_siglip"])
def test_greedy_matches_transformers(tower: str, extensible: bool, request) -> None:
    """One image, two, none and a repeated one, as a batch and one by one: the same prompt
    ids as transformers' processor makes and the same greedy tokens."""
    path = request.getfixturevalue(tower)
    expected_ids, expected = hf_greedy_with_images(path, PROMPTS, GREEDY.max_tokens)
    llm = LLM(path, enable_extensible_kv_cache=extensible, **SMALL)
    outputs = llm.generate(multimodal_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == expected_ids
    assert tokens(outputs) == expected
    assert [
        tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in multimodal_prompts(PROMPTS)
    ] == (expected)
    # The images matter: another picture changes what follows.
    other = llm.generate(multimodal_prompts([(PROMPTS[0][0], [image(9)])]), GREEDY, use_tqdm=False)
    assert tokens(other) != expected[:1]
    assert_no_request_or_image_held(llm)
    assert_encoder_cache_released(llm)


@pytest.mark.parametrize("extensible", [False, True])
def test_token_id_prompts_hold_one_placeholder_per_image(llava: Path, extensible: bool) -> None:
    llm = LLM(llava, enable_extensible_kv_cache=extensible, **SMALL)
    tokenizer = llm.get_tokenizer()
    by_text = llm.generate(multimodal_prompts(PROMPTS), GREEDY, use_tqdm=False)
    by_ids = llm.generate(
        [
            {"prompt_token_ids": tokenizer.encode(text), "multi_modal_data": {"image": images}}
            for text, images in PROMPTS
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert tokens(by_ids) == tokens(by_text)
    assert [o.prompt_token_ids for o in by_ids] == [o.prompt_token_ids for o in by_text]
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert by_ids[1].prompt_token_ids.count(image_token) == 2 * IMAGE_TOKENS
    # A single image need not be in a list.
    single = {"prompt": PROMPTS[0][0], "multi_modal_data": {"image": PROMPTS[0][1][0]}}
    assert tokens(llm.generate(single, GREEDY, use_tqdm=False)) == tokens(by_text)[:1]


@pytest.mark.parametrize("extensible", [False, True])
def test_chunked_prefill_across_an_image_encodes_it_once(llava: Path, extensible: bool) -> None:
    """Steps of 6 tokens: every image's 16 placeholders straddle chunk boundaries; the
    tokens are transformers', and each distinct image was encoded once."""
    _, expected = hf_greedy_with_images(llava, PROMPTS, GREEDY.max_tokens)
    llm = LLM(
        llava,
        enable_extensible_kv_cache=extensible,
        **{**SMALL, "max_num_batched_tokens": 6, "max_num_seqs": 2},
    )
    assert llm.memory_report()["encoder_cache_tokens"] == IMAGE_TOKENS  # one image at a time
    for prompt, want in zip(multimodal_prompts(PROMPTS), expected, strict=True):
        assert tokens(llm.generate(prompt, GREEDY, use_tqdm=False)) == [want]
    # Images 1, 2, 3, then 1 again (evicted by then: the cache holds one image): each
    # encoded once, not once per chunk it spans.
    stats = llm.engine.stats()
    assert (stats.encoder_cache_misses, stats.encoder_cache_hits) == (4, 0)
    assert tokens(llm.generate(multimodal_prompts(PROMPTS), GREEDY, use_tqdm=False)) == expected
    assert_no_request_or_image_held(llm)
    assert_encoder_cache_released(llm)


def test_n_completions_share_the_prompt_and_its_image(llava: Path) -> None:
    """n = 3 greedy completions of an image prompt: the same tokens as one, the image
    encoded once. Without prefix caching each completion finds it in the encoder cache;
    with it, they take the prompt's blocks, image positions included, and need it not."""
    for caching in (False, True):
        llm = LLM(llava, enable_prefix_caching=caching, **SMALL)
        prompt = multimodal_prompts(PROMPTS[:1])[0]
        [one] = tokens(llm.generate(prompt, GREEDY, use_tqdm=False))
        cache = llm.engine.scheduler.encoder_cache
        hits = cache.num_hits
        n3 = SamplingParams(n=3, temperature=0, max_tokens=GREEDY.max_tokens)
        [output] = llm.generate(prompt, n3, use_tqdm=False)
        assert [c.token_ids for c in output.outputs] == [one] * 3
        assert cache.num_misses == 1
        assert cache.num_hits == (hits if caching else hits + 3)
        assert_no_request_or_image_held(llm)
        assert_encoder_cache_released(llm)


@pytest.mark.parametrize("extensible", [False, True])
def test_identical_images_share_one_entry_and_hit(llava: Path, extensible: bool) -> None:
    llm = LLM(llava, enable_extensible_kv_cache=extensible, **SMALL)
    same = [(f"{IMAGE_TOKEN} one", [image(5)]), (f"two {IMAGE_TOKEN}", [image(5)])]
    llm.generate(multimodal_prompts(same), GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.encoder_cache_misses, stats.encoder_cache_hits) == (1, 1)
    assert stats.encoder_cache_entries == 1
    assert stats.encoder_cache_used_tokens == IMAGE_TOKENS
    # The same picture decoded anew (another object, same pixels) later: a hit again.
    again = image(5).copy()
    llm.generate({"prompt": f"{IMAGE_TOKEN} three", "multi_modal_data": {"image": again}})
    stats = llm.engine.stats()
    assert (stats.encoder_cache_misses, stats.encoder_cache_hits) == (1, 2)
    # Twice in one prompt: one entry, one miss and one hit.
    twice = {"prompt": f"{IMAGE_TOKEN}{IMAGE_TOKEN}", "multi_modal_data": {"image": [image(6)] * 2}}
    llm.generate(twice, GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.encoder_cache_misses, stats.encoder_cache_hits) == (2, 3)
    assert_encoder_cache_released(llm)


def test_a_full_encoder_cache_evicts_what_no_request_holds(llava: Path) -> None:
    """A budget of one image: each new image evicts the last one, the runner drops its
    tensor, and the evicted image is a miss when it comes back."""
    llm = LLM(llava, **{**SMALL, "max_num_batched_tokens": 8, "max_num_seqs": 2})
    expected = [
        tokens(llm.generate(p, GREEDY, use_tqdm=False)) for p in multimodal_prompts(PROMPTS[:2])
    ]
    assert llm.engine.stats().encoder_cache_entries == 1  # image 3, the last one encoded
    assert len(llm.engine.runner.encoder_outputs) == 1
    again = tokens(llm.generate(multimodal_prompts(PROMPTS[:1]), GREEDY, use_tqdm=False))
    assert again == expected[0]
    assert llm.engine.stats().encoder_cache_misses == 4  # 1, 2, 3, then 1 again


def test_a_request_waits_until_its_images_fit(llava: Path) -> None:
    """Encoder budget of one image, two requests with an image each: the second is not
    admitted before the first has prefilled past its image, then gets the room."""
    config = {**SMALL, "max_num_batched_tokens": 16, "max_num_seqs": 2}
    llm = LLM(llava, async_scheduling=False, **config)
    engine = llm.engine
    for text, images in [(f"{IMAGE_TOKEN} a", [image(7)]), (f"{IMAGE_TOKEN} b", [image(8)])]:
        ids, inputs = engine.process_multimodal(engine.encode(text), {"image": images})
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=3), images=inputs)
    engine.step()  # 16 tokens of the first prompt: its image, which fills the cache
    assert [s.request_id for s in engine.scheduler.waiting] == ["1"]
    assert engine.stats().encoder_cache_misses == 1
    engine.step()  # the first prompt's last token, and the second's image in the room freed
    assert not engine.scheduler.waiting
    assert engine.stats().encoder_cache_misses == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_request_or_image_held(llm)
    assert_encoder_cache_released(llm)


@pytest.mark.parametrize("extensible", [False, True])
def test_preemption_and_prefix_caching_keep_the_tokens(llava: Path, extensible: bool) -> None:
    """Too few KV blocks for the batch (requests are preempted and recomputed, images
    encoded again or found), and prefix caching, whose blocks of placeholders are told
    apart by their images: the tokens stay transformers'."""
    _, expected = hf_greedy_with_images(llava, PROMPTS, GREEDY.max_tokens)
    tight_kv = {"num_gpu_blocks_override": 8, "block_size": 8, "max_model_len": 64}
    tight = LLM(llava, enable_extensible_kv_cache=extensible, **{**SMALL, **tight_kv})
    assert tokens(tight.generate(multimodal_prompts(PROMPTS), GREEDY, use_tqdm=False)) == expected
    assert tight.engine.stats().num_preemptions > 0
    assert_no_request_or_image_held(tight)
    assert_encoder_cache_released(tight)
    cached = LLM(
        llava,
        enable_prefix_caching=True,
        enable_extensible_kv_cache=extensible,
        **{**SMALL, "block_size": 8},
    )
    text = f"a long enough prefix of words {IMAGE_TOKEN} and then more words"
    same_text = [(text, [image(1)]), (text, [image(4)])]
    ids, want = hf_greedy_with_images(llava, same_text, GREEDY.max_tokens)
    for prompt, tokens_wanted in zip(multimodal_prompts(same_text), want, strict=True):
        assert tokens(cached.generate(prompt, GREEDY, use_tqdm=False)) == [tokens_wanted]
    # Another image: only the whole blocks before it come from the cache.
    offset = ids[0].index(cached.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN))
    assert cached.engine.stats().num_cached_prompt_tokens == offset // 8 * 8 > 0
    # The first image again: every whole block but the last token's.
    assert (
        tokens(cached.generate(multimodal_prompts(same_text[:1]), GREEDY, use_tqdm=False))
        == want[:1]
    )
    again = (len(ids[0]) - 1) // 8 * 8
    assert cached.engine.stats().num_cached_prompt_tokens == offset // 8 * 8 + again


def test_two_ranks_encode_alike(llava: Path) -> None:
    """Tensor parallel: every rank holds the vision tower and its own encoder cache, kept
    in step by the step inputs (images to encode, entries to drop); chunks of 6 tokens."""
    options = {**SMALL, "max_num_batched_tokens": 6, "max_num_seqs": 2}
    _, expected = hf_greedy_with_images(llava, PROMPTS, GREEDY.max_tokens)
    llm = LLM(llava, tensor_parallel_size=2, **options)
    try:
        assert tokens(llm.generate(multimodal_prompts(PROMPTS), GREEDY, use_tqdm=False)) == expected
        assert_encoder_cache_released(llm)
    finally:
        llm.close()


def test_memory_report_keeps_the_encoder_cache_out_of_the_kv_cache(
    llava: Path, qwen3: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="extkv"):
        llm = LLM(llava, enable_extensible_kv_cache=True, **SMALL)
    report = llm.memory_report()
    hidden = 64  # the text model's
    assert report["encoder_cache_tokens"] == SMALL["max_num_batched_tokens"]
    assert report["encoder_cache_bytes"] == report["encoder_cache_tokens"] * hidden * 4
    assert report["encoder_activation_peak_bytes"] >= 0
    budget = SMALL["cpu_memory_budget_bytes"]
    assert report["available_bytes"] == (
        budget
        - report["weights_bytes"]
        - report["activation_peak_bytes"]
        - report["encoder_cache_bytes"]
    )
    messages = [r.getMessage() for r in caplog.records]
    encoder = next(i for i, m in enumerate(messages) if m.startswith("Encoder cache: 512 "))
    reserve = next(i for i, m in enumerate(messages) if m.startswith("Reserved address space"))
    assert next(i for i, m in enumerate(messages) if "encoding 32 images" in m) < encoder < reserve
    text_only = LLM(qwen3, **SMALL).memory_report()
    assert text_only["encoder_cache_bytes"] == text_only["encoder_activation_peak_bytes"] == 0


@pytest.fixture(scope="module", params=[False, True], ids=["legacy", "extensible"])
def llm(llava: Path, request: pytest.FixtureRequest) -> LLM:
    return LLM(
        llava, limit_mm_per_prompt={"image": 2}, enable_extensible_kv_cache=request.param, **SMALL
    )


def corrupt_image() -> Image.Image:
    """A PNG whose data is cut short: PIL opens it lazily and fails on decoding."""
    buffer = io.BytesIO()
    image(1, (64, 64)).save(buffer, format="PNG")
    return Image.open(io.BytesIO(buffer.getvalue()[:200]))


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (
            {"prompt": f"{IMAGE_TOKEN}", "multi_modal_data": {"image": corrupt_image()}},
            r"multi_modal_data\['image'\]\[0\] cannot be read as an image",
        ),
        (
            {"prompt": IMAGE_TOKEN * 3, "multi_modal_data": {"image": [image(1)] * 3}},
            r"\['image'\] has 3 images, more than limit_mm_per_prompt=\{'image': 2\}",
        ),
        (
            {"prompt": f"{IMAGE_TOKEN} {IMAGE_TOKEN}", "multi_modal_data": {"image": image(1)}},
            r"2 image placeholder token\(s\) .* multi_modal_data\['image'\] has 1 image",
        ),
        (
            {"prompt": "no placeholder", "multi_modal_data": {"image": image(1)}},
            r"0 image placeholder token\(s\) .* has 1 image",
        ),
        ({"prompt": IMAGE_TOKEN}, r"1 image placeholder token\(s\) .* has 0 image"),
        (
            {"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": "cat.png"}},
            r"multi_modal_data\['image'\]\[0\] must be a PIL.Image.Image; got str",
        ),
        (
            {"prompt": IMAGE_TOKEN, "multi_modal_data": {"video": [image(1)]}},
            r"multi_modal_data: modality 'video' is not supported",
        ),
    ],
)
def test_bad_images_are_refused_and_nothing_leaks(llm: LLM, prompt: dict, match: str) -> None:
    before = llm.engine.stats()
    good = {"prompt": f"{IMAGE_TOKEN} fine", "multi_modal_data": {"image": image(11)}}
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_request_or_image_held(llm)
    after = llm.engine.stats()
    assert after.encoder_cache_entries == before.encoder_cache_entries
    assert (after.encoder_cache_misses, after.encoder_cache_hits) == (
        before.encoder_cache_misses,
        before.encoder_cache_hits,
    )


def test_a_failed_step_forgets_the_images_it_was_to_encode(
    llava: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder fails in a step: its request fails, the entry it was to hold is
    forgotten (not left for a later request to find empty), and the same image then
    works."""
    llm = LLM(llava, **SMALL)
    prompt = {"prompt": f"{IMAGE_TOKEN} again", "multi_modal_data": {"image": image(12)}}
    model = llm.engine.runner.model

    def broken(pixels: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the encoder broke")

    monkeypatch.setattr(model, "encode_images", broken)
    with pytest.raises(RequestFailedError, match="the encoder broke"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    cache = llm.engine.scheduler.encoder_cache
    assert cache.num_entries == 0 and cache.num_misses == 1
    assert (
        tokens(llm.generate(prompt, GREEDY, use_tqdm=False))
        == hf_greedy_with_images(llava, [(prompt["prompt"], [image(12)])], GREEDY.max_tokens)[1]
    )
    assert (cache.num_misses, cache.num_hits) == (2, 0)
    assert_no_request_or_image_held(llm)
    assert_encoder_cache_released(llm)


def test_images_on_a_text_only_model_are_refused(qwen3: Path) -> None:
    llm = LLM(qwen3, limit_mm_per_prompt={"image": 1}, **SMALL)  # the limit means nothing here
    prompt = {"prompt": "hello", "multi_modal_data": {"image": image(1)}}
    with pytest.raises(ValueError, match=r"multi_modal_data: model .* takes no images"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    part = {"type": "image_url", "image_url": {"url": png_data_url(image(1))}}
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: this model takes no images"):
        llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)
    assert_no_request_or_image_held(llm)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"video": 1}, "limit_mm_per_prompt: modality 'video' is not supported"),
        ({"image": -1}, "limit_mm_per_prompt must be a dict"),
        ("image=x", "limit_mm_per_prompt must be a dict"),
        (3, "limit_mm_per_prompt must be a dict"),
        ("nowhere", "allowed_local_media_path must be an existing folder"),
    ],
)
def test_bad_multimodal_options(llava: Path, value: object, match: str) -> None:
    name = "allowed_local_media_path" if value == "nowhere" else "limit_mm_per_prompt"
    with pytest.raises(ValueError, match=match):
        LLM(llava, **{name: value}, **SMALL)


def test_limit_from_the_command_line_form(llava: Path) -> None:
    from extkv.engine.multimodal import check_limit_mm_per_prompt

    assert check_limit_mm_per_prompt("image=3") == {"image": 3}
    assert check_limit_mm_per_prompt('{"image": 0}') == {"image": 0}
    llm = LLM(llava, limit_mm_per_prompt="image=0", **SMALL)
    with pytest.raises(ValueError, match=r"limit_mm_per_prompt=\{'image': 0\}"):
        llm.generate({"prompt": IMAGE_TOKEN, "multi_modal_data": {"image": image(1)}})


@pytest.mark.parametrize("extensible", [False, True])
def test_chat_takes_image_parts(llava: Path, tmp_path: Path, extensible: bool) -> None:
    """Content parts with a data: URL, a file:// URL inside the allowed folder and a PIL
    image give the tokens of the same prompt written out; the template gets the parts
    (it loops over them), so the images come first, as llava-hf's templates put them."""
    folder = tmp_path / "media"
    folder.mkdir()
    image(2).save(folder / "two.png")
    llm = LLM(
        llava,
        allowed_local_media_path=str(folder),
        enable_extensible_kv_cache=extensible,
        **SMALL,
    )
    content = [
        {"type": "text", "text": "What is in these?"},
        {"type": "image_url", "image_url": {"url": png_data_url(image(1))}},
        {"type": "image_url", "image_url": {"url": f"file://{folder}/two.png"}},
        {"type": "image_pil", "image_pil": image(3)},
    ]
    chat = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    text = f"USER: {IMAGE_TOKEN}\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}\nWhat is in these?\nASSISTANT:"
    images = [image(1), image(2), image(3)]
    plain = llm.generate(multimodal_prompts([(text, images)]), GREEDY, use_tqdm=False)
    assert tokens(chat) == tokens(plain)
    assert chat[0].prompt_token_ids == plain[0].prompt_token_ids
    assert_encoder_cache_released(llm)


def test_chat_with_a_string_template_puts_placeholders_before_the_text(llava: Path) -> None:
    llm = LLM(llava, **SMALL)
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    part = {"type": "image_url", "image_url": {"url": png_data_url(image(1))}}
    content = [{"type": "text", "text": "hi"}, part]
    chat = llm.chat([{"role": "user", "content": content}], GREEDY, chat_template=template)
    plain = llm.generate(multimodal_prompts([(f"{IMAGE_TOKEN}\nhi|", [image(1)])]), GREEDY)
    assert chat[0].prompt_token_ids == plain[0].prompt_token_ids
    assert tokens(chat) == tokens(plain)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("https://example.com/cat.png", "remote image URLs are fetched only from the hosts"),
        ("file:///etc/hostname", "outside --allowed-local-media-path"),
        ("data:image/png;base64,!!!", "payload is not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
        ("data:image/png,abc", "must be data:<type>;base64,<data>"),
        ("ftp://host/x.png", "image URLs must be data: URLs"),
    ],
)
def test_chat_refuses_bad_image_urls(llava: Path, tmp_path: Path, url: str, match: str) -> None:
    llm = LLM(llava, allowed_local_media_path=str(tmp_path), **SMALL)
    part = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]\.image_url: .*" + match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert_no_request_or_image_held(llm)


def test_file_urls_need_the_allowed_folder(llava: Path, tmp_path: Path) -> None:
    image(1).save(tmp_path / "one.png")
    llm = LLM(llava, **SMALL)
    part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/one.png"}}
    with pytest.raises(ValueError, match="need the engine started with --allowed-local-media"):
        llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)


@pytest.mark.gpu
def test_cuda_graphs_legacy_equals_extensible_and_chunks_change_nothing(llava: Path) -> None:
    """On CUDA, decode graphs on: images only enter prefill, so the legacy and the
    extensible KV cache, and prefill in chunks that cut the images, give the same tokens;
    the profile measured the encoder there (the allocator's peak is exact)."""
    options = dict(device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for extra in ({}, {"enable_extensible_kv_cache": True}, {"max_num_batched_tokens": 8}):
        llm = LLM(llava, max_num_seqs=8, **options, **extra)
        assert llm.engine.runner.graphs is not None
        runs.append(tokens(llm.generate(multimodal_prompts(PROMPTS), params, use_tqdm=False)))
        report = llm.memory_report()
        assert report["encoder_cache_bytes"] > 0 and report["encoder_activation_peak_bytes"] > 0
        assert_no_request_or_image_held(llm)
        llm.close()
    assert runs[0] == runs[1] == runs[2]


@pytest.fixture
def image_host(tmp_path: Path) -> Iterator[str]:
    """A local HTTP server on 127.0.0.1: /two.png an image, /big.png too many bytes,
    /slow.png bytes trickling in, /away a redirect to the same file on "localhost"
    (another host name), else 404. Yields its base URL."""
    import http.server
    import threading

    body = io.BytesIO()
    image(2).save(body, format="PNG")
    files = {"/two.png": body.getvalue(), "/big.png": bytes(2048)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/slow.png":  # a byte every 0.1 s, for 3 s in all
                self.send_response(200)
                self.end_headers()
                for _ in range(30):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
                return
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/two.png")
                self.end_headers()
                return
            data = files.get(self.path)
            self.send_response(200 if data else 404)
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    thread.join()


def test_remote_images_come_from_the_allowed_hosts_only(
    llava: Path, image_host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An http:// URL on an allowed host gives the tokens of the same image inline; a host
    not listed, a redirect to one, a missing file, an oversized one and one that trickles
    in past the time limit are refused by a ValueError that says which, and nothing is
    queued."""
    from extkv.engine import chat_content

    llm = LLM(llava, allowed_media_domains="127.0.0.1", **SMALL)
    assert llm.engine.config.allowed_media_domains == ("127.0.0.1",)

    def chat(url: str) -> list[list[int]]:
        part = {"type": "image_url", "image_url": {"url": url}}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]
        return tokens(llm.chat(messages, GREEDY, use_tqdm=False))

    assert chat(f"{image_host}/two.png") == chat(png_data_url(image(2)))
    monkeypatch.setattr(chat_content, "MAX_IMAGE_BYTES", 1024)
    monkeypatch.setattr(chat_content, "FETCH_TIMEOUT_S", 0.5)
    for url, match in [
        (f"{image_host}/slow.png", "took over 0.5 s"),
        ("http://localhost/two.png", r"'localhost' is not one of --allowed-media-domains"),
        (f"{image_host}/away", r"\(redirected\): 'localhost' is not one of"),
        (f"{image_host}/none.png", "failed: HTTP 404"),
        (f"{image_host}/big.png", "holds more than 1024 bytes"),
    ]:
        with pytest.raises(ValueError, match=r"image_url.*" + match):
            chat(url)
    assert_no_request_or_image_held(llm)


@pytest.mark.parametrize("value", ["", [], ["https://a.org"], ["a.org/x"], 3])
def test_bad_media_domains_are_refused_by_name(llava: Path, value: object) -> None:
    with pytest.raises(ValueError, match=r"allowed_media_domains must be None or a non-empty"):
        LLM(llava, allowed_media_domains=value, **SMALL)
