"""Gemma 3 with images end to end on the CPU: greedy tokens and prompt ids equal
transformers' (its processor's expansion of `<start_of_image>`, newlines joined; its mask:
an image's tokens see each other in the prefill, the local layers' window still bounds
them) for one image, two, none and a batch, prompts longer than the window; legacy equal
to extensible; token-id prompts; prefill chunks that never cut an image; prefix cache hits
inside an image; the encoder cache; chat through Gemma 3's template; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from transformers.models.gemma3 import modeling_gemma3

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint, make_random_gemma3
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
BOI = "<start_of_image>"
IMAGE_TOKENS = 4  # 28 x 28 pixels in 7 x 7 patches, pooled 2 x 2
WINDOW = 12  # the local layers'
# transformers applies the local layers' window to an image's tokens too (AND, not OR)
# since the fix of its Gemma 3 masks; before, an image longer than the window differs.
WINDOW_BOUNDS_IMAGES = hasattr(modeling_gemma3, "create_masks_for_vision_model")

# (text, images): one image in a prompt longer than the window; three, two of them side
# by side (their newlines join); none; the first image again after other text.
PROMPTS = [
    (f"hi\n{BOI} what is this picture? tell me more about it please", [image(1)]),
    (f"compare {BOI} and {BOI}{BOI} please", [image(2), image(3, (20, 50)), image(4)]),
    ("no picture here, just text that runs on past the window", []),
    (f"The quick brown fox {BOI}", [image(1)]),
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_gemma3(tmp_path_factory.mktemp("gemma3_vl"))


@pytest.fixture(scope="module")
def expected(gemma3: Path) -> tuple[list[list[int]], list[list[int]]]:
    ids, outputs = hf_greedy_with_images(gemma3, PROMPTS, GREEDY.max_tokens)
    assert all(len(i) > WINDOW for i in ids)
    return ids, outputs


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_greedy_matches_transformers(gemma3: Path, expected: tuple, extensible: bool) -> None:
    """As a batch and one by one: transformers' prompt ids (the processor's expansion,
    newlines around the images joined with the prompt's) and greedy tokens."""
    expected_ids, want = expected
    llm = LLM(gemma3, enable_extensible_kv_cache=extensible, **SMALL)
    assert llm.engine.runner.image_spec.bidirectional
    outputs = llm.generate(multimodal_prompts(PROMPTS), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == expected_ids
    assert tokens(outputs) == want
    one_by_one = [
        tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in multimodal_prompts(PROMPTS)
    ]
    assert one_by_one == want
    # The images matter: another picture changes what follows.
    other = llm.generate(multimodal_prompts([(PROMPTS[0][0], [image(9)])]), GREEDY, use_tqdm=False)
    assert tokens(other) != want[:1]
    assert_no_request_or_image_held(llm)
    assert_encoder_cache_released(llm)


def test_image_tokens_see_each_other(gemma3: Path, expected: tuple) -> None:
    """transformers with its image tokens only looking back (no token_type_ids) gives
    other tokens than with them seeing each other, which extkv's are."""
    _, want = expected
    _, causal = hf_greedy_with_images(gemma3, PROMPTS, GREEDY.max_tokens, causal=True)
    assert causal != want


@pytest.mark.skipif(not WINDOW_BOUNDS_IMAGES, reason="transformers lets images cross the window")
def test_images_longer_than_the_window(tmp_path: Path) -> None:
    """16 tokens an image, a window of 12: the local layers see an image's tokens ahead
    but never more than the window back, as transformers' mask."""
    path = make_random_gemma3(tmp_path, mm_tokens_per_image=16)
    prompts = PROMPTS[:2]
    ids, want = hf_greedy_with_images(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, **SMALL)
    outputs = llm.generate(multimodal_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == ids
    assert tokens(outputs) == want


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_token_id_prompts_hold_one_placeholder_per_image(
    gemma3: Path, expected: tuple, extensible: bool
) -> None:
    """`<start_of_image>`'s id once per image, as vLLM takes them: the engine expands it as
    the processor does, newlines joined with the prompt's."""
    expected_ids, want = expected
    llm = LLM(gemma3, enable_extensible_kv_cache=extensible, **SMALL)
    tokenizer = llm.get_tokenizer()
    by_ids = llm.generate(
        [
            {"prompt_token_ids": tokenizer.encode(text), "multi_modal_data": {"image": images}}
            for text, images in PROMPTS
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.prompt_token_ids for o in by_ids] == expected_ids
    assert tokens(by_ids) == want
    image_token = tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert by_ids[1].prompt_token_ids.count(image_token) == 3 * IMAGE_TOKENS


def image_runs(ids: list[int], image_token: int) -> list[tuple[int, int]]:
    """(first position, end) of each run of image tokens in `ids`."""
    runs = []
    for i, t in enumerate(ids):
        if t == image_token and (i == 0 or ids[i - 1] != image_token):
            runs.append([i, i + 1])
        elif t == image_token:
            runs[-1][1] = i + 1
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_chunked_prefill_never_cuts_an_image(
    gemma3: Path, expected: tuple, extensible: bool
) -> None:
    """Steps of 6 tokens over prompts whose images would straddle them: each step ends
    before an image it cannot hold whole, so no prefix computed ever ends inside one; the
    tokens stay transformers'."""
    expected_ids, want = expected
    llm = LLM(
        gemma3,
        enable_extensible_kv_cache=extensible,
        async_scheduling=False,
        **{**SMALL, "max_num_batched_tokens": 6, "max_num_seqs": 2},
    )
    engine = llm.engine
    image_token = llm.get_tokenizer().convert_tokens_to_ids("<image_soft_token>")
    runs = {str(i): image_runs(ids, image_token) for i, ids in enumerate(expected_ids)}
    # The steps would cut the first prompt's image at 6 tokens.
    [(first_image, end)] = runs["0"]
    assert first_image < 6 < end
    for text, images in PROMPTS:
        ids, inputs = engine.process_multimodal(engine.encode(text), {"image": images})
        engine.add_request(ids, GREEDY, images=inputs)
    outputs, stops = {}, set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        for seq in engine.scheduler.running:
            computed = seq.num_computed_tokens
            stops.add(computed)
            assert not any(first < computed < end for first, end in runs[seq.request_id])
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == want
    assert first_image in stops  # a step ended short, before the image
    assert_no_request_or_image_held(llm)
    assert_encoder_cache_released(llm)


def test_two_ranks_compute_alike(gemma3: Path, expected: tuple) -> None:
    """Tensor parallel: every rank holds the vision tower, and takes the key bounds of a
    step's images with its inputs; steps of 6 tokens."""
    _, want = expected
    options = {**SMALL, "max_num_batched_tokens": 6, "max_num_seqs": 2}
    llm = LLM(gemma3, tensor_parallel_size=2, **options)
    try:
        assert tokens(llm.generate(multimodal_prompts(PROMPTS), GREEDY, use_tqdm=False)) == want
        assert_encoder_cache_released(llm)
    finally:
        llm.close()


def test_a_step_budget_below_one_image_is_refused(gemma3: Path) -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=3 is below the 4 tokens"):
        LLM(gemma3, **{**SMALL, "max_num_batched_tokens": 3, "max_num_seqs": 1})


@pytest.mark.parametrize("layer_types", [None, ["full_attention"]], ids=["local", "global"])
def test_a_prefix_cache_hit_may_end_inside_an_image(
    tmp_path: Path, layer_types: list[str] | None
) -> None:
    """The same image, then another question: the cached blocks end inside the image's
    run (their keys were computed with the whole image seen), the rest of it is computed
    after them; the tokens stay transformers'. With local layers too (window 12) and
    with global layers only."""
    overrides = {"layer_types": layer_types} if layer_types else None
    path = make_random_gemma3(tmp_path, text_overrides=overrides)
    first = f"a long enough prefix of words {BOI} what colour is it?"
    second = f"a long enough prefix of words {BOI} and its shape?"
    prompts = [(first, [image(5)]), (second, [image(5)])]
    ids, want = hf_greedy_with_images(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, enable_prefix_caching=True, block_size=8, **SMALL)
    assert bool(llm.engine.block_manager.windowed) == (layer_types is None)
    image_token = llm.get_tokenizer().convert_tokens_to_ids("<image_soft_token>")
    [(start, end)] = image_runs(ids[1], image_token)
    same = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    cached = same // 8 * 8
    assert start < cached < end  # the last common block ends inside the image
    assert tokens(llm.generate(multimodal_prompts(prompts[:1]), GREEDY, use_tqdm=False)) == want[:1]
    assert tokens(llm.generate(multimodal_prompts(prompts[1:]), GREEDY, use_tqdm=False)) == want[1:]
    assert llm.engine.stats().num_cached_prompt_tokens == cached
    assert_no_request_or_image_held(llm)


def test_a_repeated_image_hits_the_encoder_cache(gemma3: Path) -> None:
    llm = LLM(gemma3, **SMALL)
    same = [(f"{BOI} one", [image(5)]), (f"two {BOI}", [image(5)])]
    llm.generate(multimodal_prompts(same), GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.encoder_cache_misses, stats.encoder_cache_hits) == (1, 1)
    assert stats.encoder_cache_used_tokens == IMAGE_TOKENS
    assert_encoder_cache_released(llm)


@pytest.mark.parametrize("extensible", [False, True], ids=["legacy", "extensible"])
def test_chat_through_gemma3s_template(gemma3: Path, extensible: bool) -> None:
    """Content parts (text, an image, text, an image) through the checkpoint's Gemma 3
    chat template: the prompt ids and tokens of transformers' processor on the same
    conversation."""

    llm = LLM(gemma3, enable_extensible_kv_cache=extensible, **SMALL)
    content = [
        {"type": "text", "text": "What is in these?"},
        {"type": "image_url", "image_url": {"url": png_data_url(image(1))}},
        {"type": "text", "text": "and"},
        {"type": "image_pil", "image_pil": image(2)},
    ]
    messages = [{"role": "user", "content": content}]
    [chat] = llm.chat(messages, GREEDY, use_tqdm=False)
    processor = transformers.AutoProcessor.from_pretrained(gemma3)
    hf_content = [content[0], {"type": "image"}, content[2], {"type": "image"}]
    hf_messages = [{"role": "user", "content": hf_content}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    assert text.count(BOI) == 2
    ids, want = hf_greedy_with_images(gemma3, [(text, [image(1), image(2)])], GREEDY.max_tokens)
    assert chat.prompt_token_ids == ids[0]
    assert chat.outputs[0].token_ids == want[0]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (
            {"prompt": f"{BOI} {BOI}", "multi_modal_data": {"image": image(1)}},
            r"2 image placeholder token\(s\) \(id \d+\) and multi_modal_data\['image'\] has 1",
        ),
        ({"prompt": f"just {BOI}"}, r"1 image placeholder token\(s\) .* has 0 image"),
        (
            {"prompt": f"{BOI} <image_soft_token>", "multi_modal_data": {"image": image(1)}},
            r"holds the image token \(id \d+\) itself: put one image placeholder",
        ),
    ],
)
def test_bad_prompts_are_refused(gemma3: Path, prompt: dict, match: str) -> None:
    llm = LLM(gemma3, limit_mm_per_prompt={"image": 2}, **SMALL)
    good = {"prompt": f"{BOI} fine", "multi_modal_data": {"image": image(11)}}
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert_no_request_or_image_held(llm)
    assert llm.engine.stats().encoder_cache_misses == 0


def test_images_on_a_text_only_gemma3_are_refused(tmp_path: Path) -> None:
    text_only = make_random_checkpoint(tmp_path, "gemma3")
    llm = LLM(text_only, **SMALL)
    with pytest.raises(ValueError, match=r"multi_modal_data: model .* takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": image(1)}}, GREEDY)
    assert_no_request_or_image_held(llm)


def test_pan_and_scan_is_refused(gemma3: Path, tmp_path: Path) -> None:
    """Its crops would add images the prompt does not have: refused at start-up."""
    import shutil

    folder = Path(shutil.copytree(gemma3, tmp_path / "pan_and_scan"))
    config_file = folder / "processor_config.json"
    if not config_file.exists() or "image_processor" not in json.loads(config_file.read_text()):
        config_file = folder / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    (config.get("image_processor") or config)["do_pan_and_scan"] = True
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"do_pan_and_scan on .* not supported"):
        LLM(folder, **SMALL)


@pytest.mark.gpu
def test_cuda_equals_the_cpu_reference(gemma3: Path) -> None:
    """On CUDA (the Triton prefill kernel with image key bounds, decode graphs): the CPU
    engine's tokens, legacy and extensible KV cache, and steps of 8 tokens that end
    before images."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = LLM(gemma3, device="cpu", **SMALL)
    cpu = tokens(reference.generate(multimodal_prompts(PROMPTS), params, use_tqdm=False))
    options = dict(device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3)
    for extra in ({}, {"enable_extensible_kv_cache": True}, {"max_num_batched_tokens": 8}):
        llm = LLM(gemma3, max_num_seqs=8, **options, **extra)
        assert llm.engine.runner.graphs is not None
        assert tokens(llm.generate(multimodal_prompts(PROMPTS), params, use_tqdm=False)) == cpu
        report = llm.memory_report()
        assert report["encoder_cache_bytes"] > 0 and report["encoder_activation_peak_bytes"] > 0
        assert_no_request_or_image_held(llm)
        llm.close()
