"""`LLM` takes prompts the ways vLLM's does: strings, `{"prompt": ...}` and
`{"prompt_token_ids": ...}` dicts, and conversations through `chat`."""

from __future__ import annotations

from pathlib import Path

import pytest

from extkv import LLM, SamplingParams
from live_server import CHAT_TEMPLATE

SMALL = dict(cpu_memory_budget_bytes=64 << 20, max_model_len=128, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3: Path) -> LLM:
    return LLM(qwen3, **SMALL)


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_dict_prompts_equal_text_and_token_ids(llm: LLM) -> None:
    text = "the quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    expected = tokens(llm.generate(prompt_token_ids=[ids, ids[:2]], sampling_params=GREEDY))
    mixed = [{"prompt": text}, {"prompt_token_ids": ids[:2]}]
    outputs = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    assert outputs[0].prompt == text and outputs[0].prompt_token_ids == ids
    assert tokens(llm.generate(text, GREEDY, use_tqdm=False)) == expected[:1]
    assert tokens(llm.generate({"prompt": text}, GREEDY, use_tqdm=False)) == expected[:1]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"text": "hi"}, r"'prompt' \(text\) or 'prompt_token_ids'; got \['text'\]"),
        ({"prompt": 5}, "each prompt must be a string"),
        (7, "each prompt must be a string"),
        ([], "prompts must not be empty"),
    ],
)
def test_bad_prompts_are_refused_and_nothing_is_queued(llm: LLM, prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt] if prompt != [] else prompt, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_applies_the_template(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    first = [{"role": "user", "content": "hello there"}]
    second = [*first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "go"}]
    texts = [
        tokenizer.apply_chat_template(
            c, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        for c in (first, second)
    ]
    assert texts[0].endswith("<|im_start|>assistant\n")
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    expected = tokens(llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False))
    both = llm.chat([first, second], GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)
    assert tokens(both) == expected and both[1].prompt == texts[1]
    one = llm.chat(first, GREEDY, chat_template=CHAT_TEMPLATE, use_tqdm=False)
    assert tokens(one) == expected[:1]
    bare = llm.chat(
        first, GREEDY, chat_template=CHAT_TEMPLATE, add_generation_prompt=False, use_tqdm=False
    )
    assert not bare[0].prompt.endswith("<|im_start|>assistant\n")


def test_chat_needs_messages(llm: LLM) -> None:
    with pytest.raises(ValueError, match="non-empty list of messages"):
        llm.chat([], GREEDY)
