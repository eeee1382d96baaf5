"""The OpenAI fields and the extra endpoints of `extkv serve` as vLLM has them, each
through the official openai client (or plain HTTP where the client has no method)
against the live servers of conftest.py: n, lists of prompts, echo, stream_options,
temperature null, /tokenize, /detokenize, /version."""

from __future__ import annotations

import httpx
import pytest

import extkv
from extkv import LLM, SamplingParams
from extkv.serving import ServerSettings
from live_server import CHAT_TEMPLATE_FILE, KEY, MAX_MODEL_LEN, MODEL, PROMPT, Server

NO_EOS = {"ignore_eos": True, "return_token_ids": True}
TEXT = "Once upon a time"


def generate(llm: LLM, prompt: str | list[int], **params: object) -> list:
    """LLM.generate's completions of one prompt."""
    given = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    [output] = llm.generate([given], SamplingParams(**params), use_tqdm=False)
    return output.outputs


def test_seeded_n_gives_n_choices_as_generate(server: Server, reference: LLM) -> None:
    sampling = dict(temperature=1.0, seed=11, max_tokens=12)
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPT, n=3, **sampling, extra_body=NO_EOS
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    # Choice j is seeded with seed + j, as vLLM seeds a request's completions.
    want = [
        generate(reference, PROMPT, **{**sampling, "seed": 11 + j}, ignore_eos=True)[0]
        for j in range(3)
    ]
    assert [c.token_ids for c in got.choices] == [w.token_ids for w in want]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert len({tuple(c.token_ids) for c in got.choices}) == 3  # sampled apart
    assert got.usage.prompt_tokens == len(PROMPT)  # the prompt counts once
    assert got.usage.completion_tokens == 36


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
