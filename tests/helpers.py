"""Helpers shared by several test modules. They live here, not in a test module, so that
importing one never collects (or runs the imports of) another module's tests."""

from __future__ import annotations

import base64
import inspect
import io
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers.models.mamba2 import modeling_mamba2

from extkv import LLM
from extkv.attention import AttentionMetadata, ForwardContext, set_forward_context
from extkv.demo import make_random_checkpoint
from extkv.engine.sampling_params import SamplingParams
from extkv.engine.sequence import Sequence
from extkv.kv_cache import FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec
from extkv.vmm.tensor import _shared_backend

MAMBA_VOCAB = 128
# transformers before 5.2x normalised the gated RMSNorm over all groups at once, unlike
# mamba_ssm and extkv (per group, as the models were trained): against those, 1 group.
# (The class was renamed MambaRMSNormGated -> Mamba2RMSNormGated in 5.25.)
_GATED_NORM = (
    getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
)
HF_GROUPS = 2 if "group_size" in inspect.signature(_GATED_NORM.__init__).parameters else 1
# Chunks of 8: the prompts span several.
MAMBA = dict(state_size=16, n_groups=HF_GROUPS, conv_kernel=4, chunk_size=8)
MAMBA_FAMILIES = {
    "mamba2": (
        transformers.Mamba2Config,
        transformers.Mamba2ForCausalLM,
        dict(hidden_size=32, num_heads=8, head_dim=8, num_hidden_layers=2, **MAMBA),
    ),
    "bamba": (
        transformers.BambaConfig,
        transformers.BambaForCausalLM,
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_n_groups=HF_GROUPS,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            max_position_embeddings=128,
        ),
    ),
}


def make_mamba_checkpoint(
    path: Path, family: str, **overrides: object
) -> transformers.PreTrainedModel:
    """A tiny random Mamba2 or Bamba saved to `path`: every parameter drawn wide (std 0.3),
    so a wrong op or a lost state moves the logits far; dt biased low for long memory."""
    config_class, model_class, tiny = MAMBA_FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=MAMBA_VOCAB, **{**tiny, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(std=0.3)
            if name.endswith("dt_bias"):
                param.sub_(2.0)  # softplus(-2) ~ 0.13: a state remembers tens of tokens
    model.save_pretrained(path)
    return model


def deepseek_checkpoint(path: Path, architecture: str, **overrides: object) -> Path:
    """A tiny random DeepSeek V2/V3 checkpoint of 3 layers (demo size, no tokenizer); V3's
    expert score correction (zeros from transformers' init) drawn at random, so that it
    counts."""
    make_random_checkpoint(
        path, architecture, num_hidden_layers=3, with_tokenizer=False, **overrides
    )
    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensor.normal_(std=0.3, generator=generator)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


# DeepSeek's mixture of experts at tiny size: the layers from 1 on route each token to 2 of
# 8 experts (in 2 groups, 1 kept, where the router groups), plus a shared one.
DEEPSEEK_MOE = dict(
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
)
# Qwen3-MoE (demo size: 2 of 8 experts, normalised weights): layer 1 of 3 keeps its dense MLP.
QWEN3_MOE = dict(num_hidden_layers=3, mlp_only_layers=[1])


def moe_checkpoint(path: Path, model: str, **overrides: object) -> Path:
    """The tiny random mixture-of-experts checkpoint `model` names ("qwen3-moe",
    "deepseek-v2-moe", "deepseek-v3-moe"; fp32, no tokenizer), `overrides` on its config."""
    if model == "qwen3-moe":
        return make_random_checkpoint(
            path, "qwen3_moe", with_tokenizer=False, **QWEN3_MOE | overrides
        )
    overrides = DEEPSEEK_MOE | overrides
    if model == "deepseek-v2-moe":
        overrides.setdefault("topk_method", "group_limited_greedy")
    return deepseek_checkpoint(path, model.removesuffix("-moe").replace("-", "_"), **overrides)


# A tiny model's engine (test_mla, test_moe). Block size 16: the long prompts span several
# blocks; a step of at most 32 tokens cuts them into chunks, the later ones attending to a
# cached prefix.
TINY_ENGINE = dict(
    cpu_memory_budget_bytes=128 << 20,
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=16,
)
# On CUDA, against the CPU's tokens: fp32 so that they are the CPU's; a few blocks and a
# small budget, so that the tiny model's KV cache leaves the GPU to the other tests.
TINY_ENGINE_CPU = dict(TINY_ENGINE, device="cpu")
TINY_ENGINE_CUDA = dict(
    TINY_ENGINE,
    device="cuda",
    dtype=torch.float32,
    num_gpu_blocks_override=256,
    gpu_memory_utilization=0.05,
)
# min_tokens (HF: min_new_tokens) holds EOS back, so every prompt decodes 16 tokens.
GREEDY_16 = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)


def assert_legacy_equals_extensible(
    path: Path,
    prompts: list[list[int]],
    check: Callable[[LLM], None] | None = None,
    **options: object,
) -> None:
    """16 greedy tokens of each prompt and their logprobs the same to the bit on the legacy
    and the extensible KV cache (TINY_ENGINE, `options` added: tensor_parallel_size...);
    `check` looks at each engine first."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outputs = []
    for extensible in (False, True):
        llm = LLM(path, enable_extensible_kv_cache=extensible, **TINY_ENGINE, **options)
        try:
            assert llm.memory_report()["extensible"] is extensible
            if check is not None:
                check(llm)
            run = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        finally:
            llm.close()
        outputs.append([o.outputs[0] for o in run])
    legacy, extensible = outputs
    assert [o.token_ids for o in legacy] == [o.token_ids for o in extensible]
    assert [o.logprobs for o in legacy] == [o.logprobs for o in extensible]


# Attention KV cache layouts the kernels read through strides (see extkv.kv_cache.layouts).
LAYOUTS = ("split", "block_major", "hybrid")


@dataclass
class Cache:
    """One layer's K/V views over the buffer that holds them (page padding included)."""

    buf: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def random(
        cls,
        layout: str,
        num_blocks: int,
        block_size: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ) -> Cache:
        page = (block_size, heads, head_dim)
        if layout == "split":  # (2, N, B, H, D): K and V in separate segments
            buf = torch.randn(2, num_blocks, *page, dtype=dtype, device=device)
            return cls(buf, buf[0], buf[1])
        if layout == "block_major":  # (N, 2, B, H, D): K and V of a block adjacent
            buf = torch.randn(num_blocks, 2, *page, dtype=dtype, device=device)
            return cls(buf, buf[:, 0], buf[:, 1])
        assert layout == "hybrid"  # K and V of a block in one page padded to a Mamba-sized page
        kv = block_size * heads * head_dim
        buf = torch.randn(num_blocks, 2 * kv + 16 * head_dim, dtype=dtype, device=device)
        return cls(buf, buf[:, :kv].unflatten(1, page), buf[:, kv : 2 * kv].unflatten(1, page))

    def rebased(self, buf: torch.Tensor) -> Cache:
        """The same views over `buf`, a buffer shaped and strided like this one."""
        k, v = (buf.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (self.k, self.v))
        return Cache(buf, k, v)


@dataclass
class Batch:
    """A step's metadata and its new tokens' Q/K/V, strided views of one fused QKV tensor."""

    metadata: AttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


def make_batch(
    context_lens: list[int],
    q_lens: list[int],
    num_blocks: int,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    table_width: int | None = None,
) -> Batch:
    """Sequences on randomly scattered pages; the new tokens are each one's context tail."""
    pages = [-(-n // block_size) for n in context_lens]
    width = table_width or max(pages) + 1  # at least one -1 column, as the engine pads
    owned = torch.randperm(num_blocks)[: sum(pages)].to(torch.int32).split(pages)
    block_tables = torch.full((len(pages), width), -1, dtype=torch.int32)
    slots = []
    for s, (blocks, context_len, q_len) in enumerate(zip(owned, context_lens, q_lens, strict=True)):
        block_tables[s, : len(blocks)] = blocks
        pos = torch.arange(context_len - q_len, context_len)
        slots.append(blocks[pos // block_size].long() * block_size + pos % block_size)
    qkv = torch.randn(sum(q_lens), num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    query, key, value = qkv.to(device).split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    metadata = AttentionMetadata(
        is_prefill=max(q_lens) > 1,
        slot_mapping=torch.cat(slots).to(device),
        cu_seqlens_q=torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_seqlen_q=max(q_lens),
        max_context_len=max(context_lens),
    )
    return Batch(metadata, query, key, value)


def make_sequence(
    request_id: str, tokens: list[int], params: SamplingParams | None = None
) -> Sequence:
    """A request as the scheduler and the block manager hold it, with no engine around:
    the one place the unit tests build a `Sequence`."""
    return Sequence(request_id, tokens, params or SamplingParams())


def kv_groups(
    block_size: int, full: int = 1, windows: tuple[int, ...] = (), mamba: int = 0
) -> list[KVCacheGroup]:
    """KV cache groups of one layer each, as a plan orders them (attention first): `full`
    full-attention groups, a sliding-window group per entry of `windows`, `mamba` state
    groups; what the block manager reads of a model, without one."""
    attention = FullAttentionSpec(block_size, 1, 8, torch.float32)
    specs = [attention] * full
    specs += [SlidingWindowSpec(block_size, 1, 8, torch.float32, w) for w in windows]
    specs += [MambaSpec(block_size, ((4,),), (torch.float32,))] * mamba
    return [KVCacheGroup([f"layer.{i}"], spec) for i, spec in enumerate(specs)]


def backport_interpreter_index_fix() -> None:
    """Let interpreted loops take bounds loaded from memory on Triton 3.6 with numpy >= 2.4.

    That interpreter holds scalars as 1-element arrays and turns loop bounds into
    ints with `int(array)`, which such numpy refuses (triton-lang/triton#9171);
    newer Triton squeezes first, as done here.
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def run_interpreted(script: str, *args: str, timeout: float = 600) -> None:
    """Run a test file as a script under the Triton interpreter (TRITON_INTERPRET=1, set
    before Triton is imported, hence the subprocess); it must exit cleanly."""
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def interpreter_rounds_bf16_to_nearest() -> None:
    """Make the interpreter's fp32 -> bf16 casts round to nearest even, as the GPU does.

    Triton's interpreter truncates them (and its RTNE mode rounds ties up and
    drops the carry), which would hide whether a kernel rounds where torch does.
    """
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def patched(data: np.ndarray, src: object, dst: object, rounding: object) -> np.ndarray:
        if str(src) == "fp32" and str(dst) == "bf16":
            values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return convert(data, src, dst, rounding)

    interpreter._convert_float = patched


def patch_interpreter_masks() -> None:
    """Let interpreted kernels mask vectors with scalar conditions (`live & carry`).

    Triton 3.9's interpreter types a scalar comparison int32, so such a mask
    reaches its load and store as int32 and is refused; compiled kernels, and
    the interpreter once it holds the mask as bool, treat it as int1.
    """
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask: interpreter.TensorHandle) -> interpreter.TensorHandle:
        return interpreter.TensorHandle(mask.data.astype(bool), mask.dtype)

    builder.create_masked_load = lambda self, ptrs, mask, *rest: load(
        self, ptrs, as_bool(mask), *rest
    )
    builder.create_masked_store = lambda self, ptrs, value, mask, *rest: store(
        self, ptrs, value, as_bool(mask), *rest
    )


def interpreter_dots_bf16_as_numbers() -> None:
    """Make the interpreter's tl.dot multiply bf16 operands by value.

    It keeps bf16 tensors as their raw 16 bits (uint16) and hands those to
    np.matmul as integers; here they are widened to the fp32 they stand for.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widened(operand: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if operand.dtype != tl.bfloat16:
            return operand
        bits = operand.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched(self: object, a: object, b: object, d: object, *args: object) -> object:
        return dot(self, widened(a), widened(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = patched


def children() -> dict[int, bytes]:
    """This process's children (zombies included) and their command lines."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if int(stat.rpartition(")")[2].split()[1]) == os.getpid():
            found[int(entry)] = cmdline
    return found


def started_children(older: set[int]) -> set[int]:
    """This process's children not among `older` (those alive before), but multiprocessing's
    resource tracker (one per process, started with the first spawned child)."""
    return {
        pid
        for pid, cmdline in children().items()
        if b"resource_tracker" not in cmdline and pid not in older
    }


@contextmanager
def commit_limit(room_bytes: int) -> Iterator[None]:
    """The process's host backend (every engine in it commits through it) may commit only
    `room_bytes` more than it holds now, as a device whose memory others hold."""
    backend = _shared_backend(torch.device("cpu"))
    backend.commit_limit_bytes = backend.committed_bytes + room_bytes
    try:
        yield
    finally:
        backend.commit_limit_bytes = None


# The elastic-memory workload test_elastic runs on one rank, test_elastic_tensor_parallel on two.
ELASTIC_OPTIONS = dict(
    max_model_len=128,  # 8 blocks of 16 tokens: the least a resize may leave
    max_num_batched_tokens=256,
    max_num_seqs=8,
    enable_extensible_kv_cache=True,
)
MIN_BLOCKS = 8
_PREFIX = list(range(40, 72))  # two full blocks two prompts share (prefix caching)
ELASTIC_PROMPTS = [
    [*_PREFIX, 5, 6, 7],
    [*_PREFIX, *range(100, 120)],
    [17] * 3,
    list(range(200, 241)),
]
ELASTIC_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def resize_while_decoding(llm: LLM, expected: list[list[int]]) -> list[dict[str, object]]:
    """The pool resized to MIN_BLOCKS then 64 blocks (8-63 are handed out in that order), then
    ELASTIC_PROMPTS decoded to their `expected` tokens through a shrink, a grow and a deeper
    shrink: a hog holds low blocks while the prompts take higher ones, so once it is gone the
    first shrink moves their blocks down; the last one preempts some. The resize reports."""
    llm.resize_kv_cache(num_blocks=MIN_BLOCKS)
    llm.resize_kv_cache(num_blocks=64)
    schedule = [(3, {"num_blocks": 12}), (6, {"num_blocks": 48}), (20, {"num_blocks": 10})]
    hog = list(range(300, 360))
    tokens, reports = decode_through(llm, ELASTIC_PROMPTS, ELASTIC_PARAMS, schedule, hog=hog)
    assert tokens == expected
    assert [r["num_blocks"] for r in reports] == [12, 48, 10]
    assert reports[0]["num_moved_blocks"] > 0 and reports[2]["num_preempted"] > 0
    assert_nothing_leaked(llm)
    return reports


def decode_through(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams,
    schedule: list[tuple[int, dict[str, int]]],
    hog: list[int] | None = None,
) -> tuple[list[list[int]], list[dict[str, object]]]:
    """`prompts` decoded step by step, `llm.resize_kv_cache(**kwargs)` before step `i` for
    each `(i, kwargs)` of `schedule`; with `hog`, a request for it holds the first blocks
    handed out until it is aborted before step 1. Each prompt's tokens, and the resize
    reports."""
    engine = llm.engine
    hogging = engine.add_request(hog, params) if hog else None
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    reports = []
    for step in range(1000):  # a bound, so a livelock fails instead of hanging
        if not engine.has_unfinished_requests():
            break
        if step == 1 and hogging is not None:
            engine.abort_request(hogging)
        reports += [llm.resize_kv_cache(**kwargs) for at, kwargs in schedule if at == step]
        tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step(finished_only=True)}
    assert not engine.has_unfinished_requests(), "no progress within 1000 steps"
    return [tokens[i] for i in ids], reports


def hf_greedy(
    path: Path, prompts: list[list[int]], max_new_tokens: int, **generate: object
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (fp32), `generate`'s keywords added."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **generate)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_greedy_with_images(
    path: Path, prompts: list[tuple[str, list]], max_new_tokens: int, causal: bool = False
) -> tuple[list[list[int]], list[list[int]]]:
    """transformers' prompt ids and greedy continuation (fp32) of each (text, images) prompt,
    by the model class the checkpoint names; `causal`: without token_type_ids, so that
    Gemma 3's image tokens only look back."""
    architecture = transformers.AutoConfig.from_pretrained(path).architectures[0]
    model = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32)
    processor = transformers.AutoProcessor.from_pretrained(path)
    ids, outputs = [], []
    for text, images in prompts:
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        if causal:
            inputs.pop("token_type_ids")
        out = model.eval().generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        ids.append(inputs["input_ids"][0].tolist())
        outputs.append(out[0, len(ids[-1]) :].tolist())
    return ids, outputs


def multimodal_prompts(prompts: list[tuple[str, list]]) -> list[dict]:
    """(text, images) prompts as `LLM.generate` takes them."""
    return [
        {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
        for text, images in prompts
    ]


def assert_follows_transformers_in_bf16(
    path: Path, prompts: list[list[int]], tokens: list[list[int]], tolerance: float = 0.03
) -> None:
    """extkv's greedy `tokens` of each prompt are transformers' bf16 greedy ones on CUDA, or
    part from them only where transformers' two candidates' logits (nearly) tie: apart by
    at most `tolerance` of the largest logit."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.cuda().eval()
    model.generation_config.eos_token_id = None
    for prompt, ours in zip(prompts, tokens, strict=True):
        hf = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=len(ours),
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        if hf == ours:
            continue
        i = next(i for i, (a, b) in enumerate(zip(hf, ours, strict=True)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + hf[:i]], device="cuda")).logits[0, -1].float()
        gap = (logits[hf[i]] - logits[ours[i]]).abs().item()
        assert gap <= tolerance * logits.abs().max().item(), (
            f"diverged at token {i}: transformers {hf[i]} vs extkv {ours[i]}, logit gap {gap}"
        )


SMALL_VOCAB = 2048


def small_bf16_checkpoint(folder: Path, architecture: str, **shape: object) -> Path:
    """A small random bf16 checkpoint of one of extkv.demo's architectures for the GPU engine
    tests (hidden size 256, SMALL_VOCAB tokens, weights drawn at std 0.1): `shape` sets the
    layers."""
    return make_random_checkpoint(
        folder,
        architecture,
        with_tokenizer=False,
        dtype=torch.bfloat16,
        vocab_size=SMALL_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        initializer_range=0.1,
        **shape,
    )


def prompts_growing_by(step: int, n: int, vocab: int) -> list[list[int]]:
    """`n` prompts of 5, 5 + step, 5 + 2 step, ... random token ids in [1, vocab), seeded."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(1, vocab, (k,), generator=gen).tolist() for k in range(5, 5 + step * n, step)
    ]


# A small fp32 CPU engine and prompts of three lengths, for the sampling and output tests.
SAMPLING_ENGINE = dict(
    dtype=torch.float32,
    cpu_memory_budget_bytes=128 << 20,
    max_model_len=256,
    max_num_batched_tokens=256,
    max_num_seqs=8,
)
SAMPLING_PROMPTS = [[5, 6, 7, 8, 9, 100, 200], list(range(30, 71)), [17] * 3]


def greedy(max_tokens: int, **options: object) -> SamplingParams:
    """Greedy decoding of `max_tokens` tokens (EOS ignored), with any other `options`."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **options)


def boundary_stop(tokenizer, tokens: list[int]) -> tuple[int, str, str]:
    """(i, s, text): a 2-character `s` that first occurs across the end of token i, in
    the decoded `text` of `tokens`."""
    text = tokenizer.decode(tokens)
    for i in range(1, len(tokens) - 1):
        head = tokenizer.decode(tokens[: i + 1])
        end = len(head)
        if not text.startswith(head) or end < 1 or len(text) < end + 1:
            continue
        stop = text[end - 1 : end + 1]
        if text.find(stop) == end - 1 and "\ufffd" not in stop and not stop.isspace():
            return i, stop, text
    raise AssertionError("no token boundary to test")


def extkv_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """extkv's output token ids of each prompt."""
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    return [o.outputs[0].token_ids for o in outputs]


def assert_nothing_leaked(llm: LLM) -> None:
    """Every block free and accounted for, the cache and the pool agreeing on their size, and
    no granule mapped beyond what the committed blocks need."""
    blocks, cache = llm.engine.block_manager, llm.engine.kv_cache
    assert blocks.num_used_blocks == 0 and not any(blocks._refs)
    assert blocks.num_free_blocks == blocks.num_blocks == cache.num_blocks
    assert cache.blocks_within(cache.committed_bytes) >= cache.num_blocks
    assert cache.blocks_within(cache.committed_bytes - 1) < cache.num_blocks


@torch.inference_mode()
def extkv_logits(model: torch.nn.Module, token_ids: list[torch.Tensor]) -> torch.Tensor:
    """Logits of every token of a packed batch (no KV cache bound: causal per sequence)."""
    lengths = [len(t) for t in token_ids]
    context = ForwardContext.packed_prefill(lengths, "cpu")
    positions = torch.cat([torch.arange(n) for n in lengths])
    with set_forward_context(context):
        hidden = model(torch.cat(token_ids), positions)
    return model.compute_logits(hidden)


@torch.inference_mode()
def hf_logits(model: transformers.PreTrainedModel, token_ids: list[torch.Tensor]) -> torch.Tensor:
    """Each prompt run alone, then concatenated like the packed batch."""
    return torch.cat([model(t[None]).logits[0].float() for t in token_ids])


class FakeClock:
    """Seconds that pass only when a test says so (the elastic policy's clock)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- images (the multimodal tests) ---------------------------------------------------


def image(seed: int, size: tuple[int, int] = (40, 33)) -> Image.Image:
    """A random RGB image (the processor resizes and crops it to 28 x 28)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def png_data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_request_or_image_held(llm: LLM) -> None:
    """No request left, every KV block free, and no encoder cache entry held."""
    assert not llm.engine.has_unfinished_requests()
    blocks = llm.engine.block_manager
    assert blocks.num_used_blocks == 0 and not any(blocks._refs)
    assert llm.engine.scheduler.encoder_cache is None or (
        llm.engine.scheduler.encoder_cache.num_held_tokens == 0
    )


def assert_encoder_cache_released(llm: LLM) -> None:
    """No request holds an entry (what stays is only kept for reuse, within the budget)."""
    cache = llm.engine.scheduler.encoder_cache
    assert cache.num_held_tokens == 0
    assert cache.num_used_tokens <= cache.num_tokens
    runner = llm.engine.runner
    assert len(runner.encoder_outputs) == cache.num_entries


@torch.no_grad()
def vary_norms(model: torch.nn.Module) -> None:
    """Give every RMSNorm its own weights (about 1 +- 0.1) and eps: random checkpoints
    leave them all ones and alike, so a norm taken for another would go unseen."""
    from extkv.models.layers import RMSNorm

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for i, norm in enumerate(norms):
        norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight, dtype=torch.float32))
        norm.eps = 1e-6 * (i + 1)


def assert_replays_like_eager(fn: Callable[..., tuple], inputs: list[torch.Tensor]) -> None:
    """`fn(*inputs)` captured once in a CUDA graph (after a warm-up call outside it, which
    compiles its kernels), then replayed three times over new random values copied into
    `inputs`: each time its outputs are an eager call's, bit for bit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)
    for _ in range(3):
        for tensor in inputs:
            tensor.copy_(torch.randn_like(tensor))
        graph.replay()
        assert all(map(torch.equal, outputs, fn(*inputs)))
