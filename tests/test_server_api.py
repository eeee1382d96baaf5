"""The OpenAI fields and the extra endpoints of `extkv serve` as vLLM has them, each
through the official openai client (or plain HTTP where the client has no method)
against the live servers of conftest.py, and equal to what LLM.generate gives: n,
lists of prompts, echo, logprobs, penalties, min_tokens, logit_bias, stop,
stream_options, temperature null, /tokenize, /detokenize, /version."""

from __future__ import annotations

import httpx
import pytest

import extkv
from extkv import LLM, SamplingParams
from extkv.serving import ServerSettings
from helpers import boundary_stop
from live_server import CHAT_TEMPLATE_FILE, KEY, MAX_MODEL_LEN, MODEL, PROMPT, Server

NO_EOS = {"ignore_eos": True, "return_token_ids": True}
TEXT = "Once upon a time"


def generate(llm: LLM, prompt: str | list[int], **params: object) -> list:
    """LLM.generate's completions of one prompt (n of them)."""
    given = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    [output] = llm.generate([given], SamplingParams(**params), use_tqdm=False)
    return output.outputs


def test_list_of_prompts_numbers_choices_as_vllm(server: Server, reference: LLM) -> None:
    """Prompt i's choice j is index i * n + j; strings and token lists alike."""
    greedy = dict(temperature=0, max_tokens=6)
    tokenizer = reference.get_tokenizer()
    for prompts in (["Hello there", TEXT, "KV"], [PROMPT, [9, 8, 7], [300]]):
        got = server.client().completions.create(
            model=MODEL, prompt=prompts, n=2, **greedy, extra_body=NO_EOS
        )
        assert [c.index for c in got.choices] == list(range(6))
        for choice in got.choices:
            [want] = generate(reference, prompts[choice.index // 2], **greedy, ignore_eos=True)
            assert (choice.token_ids, choice.text) == (want.token_ids, want.text)
        ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        assert got.usage.prompt_tokens == sum(map(len, ids))
        assert got.usage.completion_tokens == 6 * 6


def test_list_of_prompts_streams_every_choice(server: Server) -> None:
    client = server.client()
    body = dict(model=MODEL, prompt=[PROMPT, [9, 8, 7]], n=2, temperature=0, max_tokens=5)
    whole = client.completions.create(**body, extra_body=NO_EOS)
    chunks = list(client.completions.create(**body, stream=True, extra_body=NO_EOS))
    assert all(len(c.choices) == 1 for c in chunks)
    for want in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == want.index]
        assert "".join(c.text for c in mine) == want.text
        assert [t for c in mine for t in c.token_ids] == want.token_ids
        assert mine[-1].finish_reason == "length"


def test_echo_prepends_the_prompt(server: Server, reference: LLM) -> None:
    client = server.client()
    greedy = dict(temperature=0, max_tokens=8)
    [want] = generate(reference, TEXT, **greedy, ignore_eos=True)
    got = client.completions.create(
        model=MODEL, prompt=TEXT, echo=True, **greedy, extra_body=NO_EOS
    )
    assert got.choices[0].text == TEXT + want.text
    streamed = client.completions.create(
        model=MODEL, prompt=TEXT, echo=True, stream=True, **greedy, extra_body=NO_EOS
    )
    chunks = [c.choices[0].text for c in streamed]
    assert chunks[0].startswith(TEXT) and "".join(chunks) == TEXT + want.text
    # Token ids are echoed as their text.
    got = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, **greedy)
    prompt_text = reference.get_tokenizer().decode(PROMPT)
    assert got.choices[0].text == prompt_text + generate(reference, PROMPT, **greedy)[0].text


def test_usage_chunk_only_when_asked(server: Server) -> None:
    client = server.client()
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, stream=True)
    plain = list(client.completions.create(**body, extra_body=NO_EOS))
    assert all(c.choices and c.usage is None for c in plain)
    off = list(client.completions.create(**body, stream_options={"include_usage": False}))
    assert all(c.choices and c.usage is None for c in off)
    asked = list(client.completions.create(**body, stream_options={"include_usage": True}))
    assert all(c.choices and c.usage is None for c in asked[:-1])
    assert asked[-1].choices == []
    assert (asked[-1].usage.prompt_tokens, asked[-1].usage.completion_tokens) == (len(PROMPT), 4)


def test_no_empty_chunks(server: Server) -> None:
    """A long stop string holds text back, so most steps have nothing to show yet: they
    send no chunk, their tokens join the next one."""
    client = server.client()
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24, stop="x" * 40)
    whole = client.completions.create(**body, extra_body=NO_EOS).choices[0]
    chunks = list(
        client.completions.create(
            **body, stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS
        )
    )
    choices = [c.choices[0] for c in chunks[:-1]]
    assert all(c.text for c in choices)
    assert 0 < len(choices) < 24
    assert "".join(c.text for c in choices) == whole.text
    assert [t for c in choices for t in c.token_ids] == whole.token_ids
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    messages = [{"role": "user", "content": "hi"}]
    del body["prompt"]
    chat = client.chat.completions.create(messages=messages, stream=True, **body, extra_body=NO_EOS)
    deltas = [c.choices[0].delta for c in chat]
    assert deltas[0].role == "assistant" and all(d.content for d in deltas)


def test_temperature_null_is_the_default(server: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "seed": 5, **NO_EOS}

    def token_ids(**changes: object) -> list[int]:
        response = httpx.post(f"{server.url}/v1/completions", json={**body, **changes})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    assert token_ids(temperature=None) == token_ids() == token_ids(temperature=1.0)
    assert token_ids(temperature=None) != token_ids(temperature=0)
    assert token_ids(top_p=None, stop=None, n=None) == token_ids()


def test_tokenize_and_detokenize(server: Server, reference: LLM) -> None:
    tokenizer = reference.get_tokenizer()

    def post(path: str, **body: object) -> dict:
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    got = post("/tokenize", model=MODEL, prompt=TEXT)
    want = tokenizer.encode(TEXT)
    assert got == {
        "tokens": want,
        "count": len(want),
        "max_model_len": MAX_MODEL_LEN,
        "token_strs": None,
    }
    got = post("/tokenize", prompt=TEXT, add_special_tokens=False, return_token_strs=True)
    assert got["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])

    messages = [{"role": "user", "content": "Hi!"}]
    for generation in (True, False):
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=CHAT_TEMPLATE_FILE,  # the server's --chat-template
            add_generation_prompt=generation,
            tokenize=False,
        )
        got = post("/tokenize", messages=messages, add_generation_prompt=generation)
        assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        assert got["count"] == len(got["tokens"])
    long = post("/tokenize", prompt="a b " * MAX_MODEL_LEN)  # all of it, past the limit
    assert long["count"] == len(tokenizer.encode("a b " * MAX_MODEL_LEN)) > MAX_MODEL_LEN

    ids = tokenizer.encode("The KV cache<|endoftext|>")
    assert post("/detokenize", model=MODEL, tokens=ids) == {"prompt": tokenizer.decode(ids)}
    assert post("/detokenize", tokens=[]) == {"prompt": ""}


def test_version(server: Server) -> None:
    response = httpx.get(f"{server.url}/version")
    assert response.status_code == 200 and response.json() == {"version": extkv.__version__}


def test_tokenize_needs_the_api_key(guarded: Server) -> None:
    body = {"prompt": "hi"}
    assert httpx.post(f"{guarded.url}/tokenize", json=body).status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    ok = httpx.post(f"{guarded.url}/tokenize", json=body, headers=headers)
    assert ok.status_code == 200 and ok.json()["count"] > 0


BAD = [
    ("/tokenize", {}, "send either prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "not both"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "'gpt-9' does not exist"),
    ("/tokenize", {"prompt": "a", "extra": 1}, "unknown field"),
    ("/detokenize", {"tokens": [10**6]}, "token id 1000000 is outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "words"), BAD)
def test_bad_tokenize_requests(server: Server, path: str, body: dict, words: str) -> None:
    response = httpx.post(server.url + path, json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert words in error["message"] and error["code"] == response.status_code


def test_chat_template_file_is_checked_at_start(tmp_path) -> None:
    with pytest.raises(ValueError, match="chat_template must be the path of a readable file"):
        ServerSettings(MODEL, chat_template=str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        ServerSettings(MODEL, chat_template=str(broken))
    fine = tmp_path / "fine.jinja"
    fine.write_text(CHAT_TEMPLATE_FILE)
    assert ServerSettings(MODEL, chat_template=str(fine)).chat_template_text() == CHAT_TEMPLATE_FILE


def test_seeded_n_equals_generate(server: Server, reference: LLM) -> None:
    sampling = dict(temperature=1.0, seed=11, max_tokens=12)
    want = generate(reference, PROMPT, n=3, **sampling, ignore_eos=True)
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPT, n=3, **sampling, extra_body=NO_EOS
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [(c.token_ids, c.text) for c in got.choices] == [(w.token_ids, w.text) for w in want]
    assert len({tuple(c.token_ids) for c in got.choices}) == 3  # sampled apart
    assert got.usage.prompt_tokens == len(PROMPT)  # the prompt counts once
    assert got.usage.completion_tokens == 36


def joined_stream(chunks: list) -> dict[int, dict]:
    """Each choice's streamed chunks joined: text, token ids and logprobs in order, the
    end from its last chunk."""
    whole: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = whole.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": []})
            got["text"] += c.text
            got["token_ids"] += c.token_ids
            got["logprobs"] += positions(c.logprobs)
            got["end"] = (c.finish_reason, c.stop_reason)
    return whole


def as_joined(choice) -> dict:
    """A non-streamed choice in joined_stream's shape."""
    return {
        "text": choice.text,
        "token_ids": choice.token_ids,
        "logprobs": positions(choice.logprobs),
        "end": (choice.finish_reason, choice.stop_reason),
    }


def positions(logprobs) -> list[tuple]:
    """A completions choice's logprobs, one (token, logprob, top) a position. Not the text
    offsets: in a stream each chunk's start at the text shown so far (as vLLM's), and with
    stop strings that holds back what could begin one."""
    fields = (logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    return list(zip(*fields, strict=True))


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_chunks_join_to_the_whole_answer(
    server: Server, reference: LLM, echo: bool
) -> None:
    """Two prompts, n = 2 choices each, logprobs, a stop string across two tokens (and the
    prompt's logprobs in each choice's first chunk, with echo): each choice's chunks joined
    are the non-streamed choice, and both hold LLM.generate's tokens and text (built whole,
    not from the engine's deltas)."""
    sampling = dict(temperature=0.5, seed=4, max_tokens=30)
    [free] = generate(reference, PROMPT, **sampling)  # choice 0's tokens (its seed is 4)
    stop = boundary_stop(reference.get_tokenizer(), free.token_ids)[1]
    sampling["stop"] = [stop]
    prompts = [PROMPT, [9, 8, 7, 300]]
    body = dict(model=MODEL, prompt=prompts, n=2, logprobs=2, echo=echo, **sampling)
    client = server.client()
    extra = {"return_token_ids": True}
    whole = client.completions.create(**body, extra_body=extra)
    streamed = joined_stream(client.completions.create(**body, stream=True, extra_body=extra))
    assert streamed == {c.index: as_joined(c) for c in whole.choices}
    ends = []
    for choice in whole.choices:
        want = generate(reference, prompts[choice.index // 2], n=2, **sampling, logprobs=2)[
            choice.index % 2
        ]
        echoed = reference.get_tokenizer().decode(prompts[choice.index // 2]) if echo else ""
        assert (choice.token_ids, choice.text) == (want.token_ids, echoed + want.text)
        chosen = [want.logprobs[i][t].logprob for i, t in enumerate(want.token_ids)]
        tail = choice.logprobs.token_logprobs[-len(chosen) :]
        assert tail == pytest.approx(chosen, abs=1e-4)  # batched otherwise: float error
        ends.append((choice.finish_reason, choice.stop_reason))
    assert ends[0] == ("stop", stop)


def ranked(candidates: dict) -> list:
    return sorted(candidates.values(), key=lambda lp: lp.rank)


def test_completion_logprobs_equal_generate(server: Server, reference: LLM) -> None:
    greedy = dict(temperature=0, max_tokens=8)
    [want] = generate(reference, PROMPT, **greedy, logprobs=3, ignore_eos=True)
    chosen = [want.logprobs[i][t] for i, t in enumerate(want.token_ids)]
    client = server.client()
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, **greedy, logprobs=3, extra_body=NO_EOS
    ).choices[0]
    logprobs = got.logprobs
    assert got.token_ids == want.token_ids
    assert logprobs.tokens == [lp.decoded_token for lp in chosen]
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in chosen], abs=1e-6)
    # Keyed by text, as vLLM's: tokens of the same text (bytes of one character) share one.
    assert logprobs.top_logprobs == [
        {lp.decoded_token: pytest.approx(lp.logprob, abs=1e-6) for lp in ranked(position)}
        for position in want.logprobs
    ]
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs)  # the top 3 and the chosen
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]

    chunks = client.completions.create(
        model=MODEL, prompt=PROMPT, **greedy, logprobs=3, stream=True, extra_body=NO_EOS
    )
    parts = [c.choices[0].logprobs for c in chunks]
    assert [t for p in parts for t in p.tokens] == logprobs.tokens
    assert [x for p in parts for x in p.token_logprobs] == logprobs.token_logprobs
    assert [x for p in parts for x in p.text_offset] == logprobs.text_offset
    assert (
        client.completions.create(model=MODEL, prompt=PROMPT, **greedy).choices[0].logprobs is None
    )


def test_echo_with_logprobs_gives_the_prompts(server: Server, reference: LLM) -> None:
    """As vLLM: the prompt's logprobs then the completion's, the first prompt token's None."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    [want] = reference.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    got = (
        server.client()
        .completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2, echo=True
        )
        .choices[0]
    )
    logprobs = got.logprobs
    completion = want.outputs[0]
    assert len(logprobs.tokens) == len(PROMPT) + len(completion.token_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.tokens[0] == reference.get_tokenizer().decode(PROMPT[:1])
    prompt = [want.prompt_logprobs[i][t].logprob for i, t in enumerate(PROMPT) if i]
    output = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
    assert logprobs.token_logprobs[1:] == pytest.approx(prompt + output, abs=1e-6)
    assert "".join(logprobs.tokens[len(PROMPT) :]) == completion.text
    assert got.text == reference.get_tokenizer().decode(PROMPT) + completion.text


def test_chat_logprobs_equal_llm_chat(server: Server, reference: LLM) -> None:
    messages = [{"role": "user", "content": "Tell me about logprobs."}]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    [want] = reference.chat(messages, params, chat_template=CHAT_TEMPLATE_FILE, use_tqdm=False)
    completion = want.outputs[0]
    client = server.client()
    body = dict(model=MODEL, messages=messages, temperature=0, max_tokens=6, extra_body=NO_EOS)
    got = client.chat.completions.create(**body, logprobs=True, top_logprobs=2).choices[0]
    content = got.logprobs.content
    chosen = [completion.logprobs[i][t] for i, t in enumerate(completion.token_ids)]
    assert [c.token for c in content] == [lp.decoded_token for lp in chosen]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in chosen], abs=1e-6)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    for c, position in zip(content, completion.logprobs, strict=True):
        top = ranked(position)[:2]
        assert [t.token for t in c.top_logprobs] == [lp.decoded_token for lp in top]
        assert c.top_logprobs[0].token == c.token  # greedy: the chosen one is the likeliest
    streamed = client.chat.completions.create(**body, logprobs=True, stream=True)
    tokens = [t.token for chunk in streamed for t in chunk.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]
    assert client.chat.completions.create(**body).choices[0].logprobs is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 1.5), ("frequency_penalty", 1.5), ("repetition_penalty", 1.8)],
)
def test_penalties_equal_generate(server: Server, reference: LLM, field: str, value: float) -> None:
    greedy = dict(temperature=0, max_tokens=32, ignore_eos=True)
    [plain] = generate(reference, PROMPT, **greedy)
    [want] = generate(reference, PROMPT, **greedy, **{field: value})
    assert want.token_ids != plain.token_ids  # the penalty changes this output
    got = server.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=32,
        extra_body={**NO_EOS, field: value},
    )
    assert got.choices[0].token_ids == want.token_ids


def test_min_tokens_defers_the_stop(server: Server, reference: LLM) -> None:
    greedy = dict(temperature=0, max_tokens=12)
    [plain] = generate(reference, PROMPT, **greedy, ignore_eos=True)
    stop = plain.token_ids[1]
    client = server.client()
    body = dict(model=MODEL, prompt=PROMPT, **greedy)
    early = client.completions.create(**body, extra_body={"stop_token_ids": [stop], **NO_EOS})
    assert early.choices[0].token_ids == plain.token_ids[:2]
    assert early.choices[0].stop_reason == stop
    [want] = generate(
        reference, PROMPT, **greedy, stop_token_ids=[stop], min_tokens=8, ignore_eos=True
    )
    late = client.completions.create(
        **body, extra_body={"stop_token_ids": [stop], "min_tokens": 8, **NO_EOS}
    )
    assert late.choices[0].token_ids == want.token_ids and len(want.token_ids) >= 8


def test_logit_bias_with_string_keys(server: Server, reference: LLM) -> None:
    client = server.client()
    greedy = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=5, extra_body=NO_EOS)
    forced = client.completions.create(**greedy, logit_bias={"300": 100})
    assert forced.choices[0].token_ids == [300] * 5
    [plain] = generate(reference, PROMPT, temperature=0, max_tokens=5, ignore_eos=True)
    first = plain.token_ids[0]
    banned = client.completions.create(**greedy, logit_bias={str(first): -100})
    bias = {first: -100.0}
    [want] = generate(
        reference, PROMPT, temperature=0, max_tokens=5, logit_bias=bias, ignore_eos=True
    )
    assert banned.choices[0].token_ids == want.token_ids and first not in want.token_ids[:1]


def test_stop_string_in_output_and_stop_reason(server: Server, reference: LLM) -> None:
    [full] = generate(reference, PROMPT, temperature=0, max_tokens=40)
    stop = full.text[12:15]
    cut = full.text[: full.text.index(stop)]
    client = server.client()
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40, stop=[stop])
    got = client.completions.create(**body).choices[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (cut, "stop", stop)
    kept = client.completions.create(**body, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop
    streamed = client.completions.create(
        **body, stream=True, extra_body={"include_stop_str_in_output": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == cut + stop


BAD_FIELDS = [
    (dict(logprobs=21), "logprobs: Input should be less than or equal to 20"),
    (dict(presence_penalty=2.5), "presence_penalty: Input should be less than or equal to 2"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty: Input should be greater than 0"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens must be at most max_tokens"),
    (dict(logit_bias={"abc": 1}), "logit_bias: keys must be token ids"),
    (dict(logit_bias={"1": "up"}), "logit_bias.1"),
    (dict(logit_bias={"999999": 1}), "vocabulary"),
]


@pytest.mark.parametrize(("changes", "words"), BAD_FIELDS)
def test_bad_sampling_fields(server: Server, changes: dict, words: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **changes}
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_bad_chat_logprobs(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "top_logprobs: allowed only with logprobs=true" in response.json()["error"]["message"]


def test_skip_special_tokens(server: Server, reference: LLM) -> None:
    tokenizer = reference.get_tokenizer()
    eos = tokenizer.eos_token_id
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, logit_bias={str(eos): 100})
    client = server.client()
    for skip, text in ((True, ""), (False, tokenizer.eos_token * 3)):
        extra = {**NO_EOS, "skip_special_tokens": skip}
        got = client.completions.create(**body, extra_body=extra).choices[0]
        assert (got.token_ids, got.text) == ([eos] * 3, text)
        streamed = client.completions.create(**body, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in streamed) == text
