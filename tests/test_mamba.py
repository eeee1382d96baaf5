"""Mamba2 and the Bamba hybrid against Hugging Face: tiny random fp32 checkpoints.

Packed prefill without states; then the engine's view of a request: states
bound to cache blocks (garbage in them, so a fresh request must ignore them),
prefill in two chunks, decode steps with a padding row, the hybrid's attention
on a hand-made paged KV cache. Every step's logits must equal HF's on the
whole sequence. The Triton decode kernels run in the interpreter on CPU (a
subprocess, as in test_kernels.py) and compiled on GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from extkv.attention import (
    Attention,
    AttentionMetadata,
    ForwardContext,
    MambaMetadata,
    set_forward_context,
)
from extkv.kv_cache.layouts import mamba_state_views
from extkv.kv_cache.specs import MambaSpec
from extkv.models import load_model
from extkv.models.mamba2 import Mamba2Mixer
from extkv.models.mamba2_ops import causal_conv_varlen, ssm_step, time_step
from helpers import (
    HF_GROUPS,
    MAMBA_FAMILIES,
    MAMBA_VOCAB,
    make_mamba_checkpoint,
    patch_interpreter_masks,
)

VARIANTS = [
    ("mamba2", {}),
    ("mamba2", {"use_bias": True, "tie_word_embeddings": True, "n_groups": 1}),
    ("bamba", {}),
    ("bamba", {"mamba_proj_bias": True, "attention_bias": True, "tie_word_embeddings": True}),
]
VARIANT_IDS = ["mamba2", "mamba2-bias-tied", "bamba", "bamba-bias-tied"]


def random_tokens(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, MAMBA_VOCAB, (n,), generator=generator) for n in lengths]


@torch.inference_mode()
def hf_logits(model: transformers.PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[None]).logits[0].float()


def mixers(model: torch.nn.Module) -> dict[str, Mamba2Mixer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Mamba2Mixer)}


def attention_layers(model: torch.nn.Module) -> dict[str, Attention]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Attention)}


# ---------------------------------------------------------------- packed prefill, no states


@torch.inference_mode()
@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=VARIANT_IDS)
def test_packed_prefill_matches_hf(tmp_path: Path, family: str, overrides: dict) -> None:
    hf = make_mamba_checkpoint(tmp_path, family, **overrides)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    tokens = random_tokens((5, 19, 1))
    lengths = [len(t) for t in tokens]
    context = ForwardContext.packed_prefill(lengths, "cpu")
    positions = torch.cat([torch.arange(n) for n in lengths])
    with set_forward_context(context):
        logits = model.compute_logits(model(torch.cat(tokens), positions))
    expected = torch.cat([hf_logits(hf, t) for t in tokens])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the engine's view


@dataclass
class Request:
    tokens: torch.Tensor  # the whole sequence: prompt, then the tokens decode feeds
    state_index: int
    blocks: list[int]  # KV cache blocks of the attention layers
    done: int = 0  # tokens already run


class Bindings:
    """States and KV caches bound like the engine does, filled with garbage."""

    NUM_BLOCKS, BLOCK_SIZE = 16, 4

    def __init__(self, model: torch.nn.Module, device: str, seed: int = 2) -> None:
        generator = torch.Generator().manual_seed(seed)
        for mixer in mixers(model).values():
            spec = MambaSpec(1, mixer.state_shapes(), mixer.state_dtypes())
            spec = MambaSpec(1, spec.shapes, spec.dtypes, page_size_padded=spec.state_bytes + 64)
            buffer = torch.empty(self.NUM_BLOCKS * spec.page_size_bytes, dtype=torch.uint8)
            mixer.ssm_state, mixer.conv_state = mamba_state_views(
                buffer.to(device), spec, self.NUM_BLOCKS
            )
            for state in (mixer.ssm_state, mixer.conv_state):
                state.copy_(torch.randn(state.shape, generator=generator))
        dtype = next(model.parameters()).dtype
        for layer in attention_layers(model).values():
            shape = (self.NUM_BLOCKS, self.BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.randn(shape, generator=generator).to(device, dtype)
            layer.v_cache = torch.randn(shape, generator=generator).to(device, dtype)

    def snapshot(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {
            f"{name}.{state}": getattr(mixer, state).clone()
            for name, mixer in mixers(model).items()
            for state in ("ssm_state", "conv_state")
        }


def step_inputs(
    requests: list[Request], counts: list[int], is_prefill: bool, device: str, padding: int = 0
) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """Flat inputs of one step advancing request i by counts[i] tokens, plus `padding`
    rows as a CUDA-graph batch has: state index -1, KV slot -1, one token of block 0."""
    block_size = Bindings.BLOCK_SIZE
    ids, positions, slots, tables = [], [], [], []
    cu, context_lens, indices, carry = [0], [], [], []
    for request, n in zip(requests, counts, strict=True):
        start = request.done
        ids.append(request.tokens[start : start + n])
        pos = torch.arange(start, start + n)
        positions.append(pos)
        blocks = torch.tensor(request.blocks)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        tables.append(request.blocks)
        cu.append(cu[-1] + n)
        context_lens.append(start + n)
        indices.append(request.state_index)
        carry.append(start > 0)
    for _ in range(padding):
        ids.append(torch.zeros(1, dtype=torch.int64))
        positions.append(torch.zeros(1, dtype=torch.int64))
        slots.append(torch.tensor([-1]))
        tables.append([0])
        cu.append(cu[-1] + 1)
        context_lens.append(1)
        indices.append(-1)
        carry.append(True)
    width = max(map(len, tables))
    i32 = dict(dtype=torch.int32, device=device)
    cu_seqlens = torch.tensor(cu, **i32)
    attention = AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=torch.cat(slots).to(device),
        cu_seqlens_q=cu_seqlens,
        context_lens=torch.tensor(context_lens, **i32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], **i32),
        max_seqlen_q=max(counts),
        max_context_len=max(context_lens),
    )
    mamba = MambaMetadata(
        is_prefill=is_prefill,
        cu_seqlens_q=cu_seqlens,
        state_indices=torch.tensor([indices], **i32),  # one state group
        has_initial_state=torch.tensor(carry, dtype=torch.bool, device=device),
    )
    context = ForwardContext((attention,), mamba)
    return torch.cat(ids).to(device), torch.cat(positions).to(device), context


PROMPTS = (6, 19, 3)
FIRST_CHUNKS = (2, 11, 1)  # second chunks 4, 8, 2: shorter than the conv window too
DECODE_STEPS = 4


def make_requests() -> list[Request]:
    tokens = random_tokens(tuple(n + DECODE_STEPS for n in PROMPTS))
    state_indices = (5, 0, 3)
    kv_blocks = ([1, 7, 15], [2, 3, 9, 10, 11, 12], [4, 6])
    return [Request(*r) for r in zip(tokens, state_indices, kv_blocks, strict=True)]


@torch.inference_mode()
def run_request_steps(model: torch.nn.Module, device: str) -> list[torch.Tensor]:
    """Logits of every step: two prefill chunks, then decode steps with one padding row."""
    requests = make_requests()
    plans = [
        (list(FIRST_CHUNKS), True, 0),
        ([p - f for p, f in zip(PROMPTS, FIRST_CHUNKS, strict=True)], True, 0),
        *[([1] * len(requests), False, 1)] * DECODE_STEPS,
    ]
    out = []
    for counts, is_prefill, padding in plans:
        ids, positions, context = step_inputs(requests, counts, is_prefill, device, padding)
        with set_forward_context(context):
            logits = model.compute_logits(model(ids, positions))
        out.append(logits[: sum(counts)].cpu())
        for request, n in zip(requests, counts, strict=True):
            request.done += n
    return out


def expected_steps(hf: transformers.PreTrainedModel) -> list[torch.Tensor]:
    """HF's logits on each whole sequence, cut into the steps of `run_request_steps`."""
    full = [hf_logits(hf, r.tokens) for r in make_requests()]
    bounds = [
        [0, f, p, *range(p + 1, p + DECODE_STEPS + 1)]
        for f, p in zip(FIRST_CHUNKS, PROMPTS, strict=True)
    ]
    return [
        torch.cat([logits[b[i] : b[i + 1]] for logits, b in zip(full, bounds, strict=True)])
        for i in range(len(bounds[0]) - 1)
    ]


def check_request_steps(
    tmp_path: Path, family: str, overrides: dict, device: str, tol: float
) -> None:
    hf = make_mamba_checkpoint(tmp_path, family, **overrides)
    model, _ = load_model(tmp_path, torch.float32, torch.device(device))
    bindings = Bindings(model, device)
    before = bindings.snapshot(model)
    steps = run_request_steps(model, device)
    for i, (got, want) in enumerate(zip(steps, expected_steps(hf), strict=True)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"step {i}")
    # Blocks no request owns, the padding row's included, keep their bytes.
    after = bindings.snapshot(model)
    unused = sorted(set(range(Bindings.NUM_BLOCKS)) - {r.state_index for r in make_requests()})
    for name, state in before.items():
        assert torch.equal(after[name][unused], state[unused]), name
        assert not torch.equal(after[name], state), f"{name} was never written"


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=VARIANT_IDS)
def test_chunked_prefill_and_decode_match_hf(tmp_path: Path, family: str, overrides: dict) -> None:
    check_request_steps(tmp_path, family, overrides, "cpu", 1e-4)


def test_fresh_request_ignores_old_state(tmp_path: Path) -> None:
    """The same step run over different garbage in the bound rows gives the same logits,
    while continuing (has_initial_state True) from that garbage does not."""
    make_mamba_checkpoint(tmp_path, "bamba")
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    requests = make_requests()

    def logits(seed: int, carry: bool) -> torch.Tensor:
        Bindings(model, "cpu", seed)
        ids, positions, context = step_inputs(requests, list(FIRST_CHUNKS), True, "cpu")
        context.mamba.has_initial_state.fill_(carry)
        with torch.inference_mode(), set_forward_context(context):
            return model.compute_logits(model(ids, positions))

    assert torch.equal(logits(0, False), logits(1, False))
    assert (logits(0, True) - logits(0, False)).abs().max() > 0.1


# ---------------------------------------------------------------- interface and loader


def test_engine_interface(tmp_path: Path) -> None:
    make_mamba_checkpoint(tmp_path, "bamba")
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    assert list(mixers(model)) == ["model.layers.0.mamba", "model.layers.2.mamba"]
    assert list(attention_layers(model)) == ["model.layers.1.self_attn.attn"]
    mixer = mixers(model)["model.layers.0.mamba"]
    conv_dim = 8 * 8 + 2 * HF_GROUPS * 16  # x, then B and C of each group of 16
    assert mixer.state_shapes() == ((8, 8, 16), (conv_dim, 3))
    assert mixer.state_dtypes() == (torch.float32, torch.float32)
    assert mixer.ssm_state.numel() == mixer.conv_state.numel() == 0

    bf16, _ = load_model(tmp_path, torch.bfloat16, "cpu")
    dtypes = mixers(bf16)["model.layers.0.mamba"].state_dtypes()
    assert dtypes == (torch.float32, torch.bfloat16)
    MambaSpec(1, mixer.state_shapes(), dtypes)  # the fp32 state first keeps both aligned


def test_bound_states_need_state_indices(tmp_path: Path) -> None:
    make_mamba_checkpoint(tmp_path, "mamba2")
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    Bindings(model, "cpu")
    ids, positions, context = step_inputs(make_requests(), list(FIRST_CHUNKS), True, "cpu")
    context.mamba.state_indices = None
    with set_forward_context(context), pytest.raises(RuntimeError, match="state_indices"):
        model(ids, positions)


def rewrite_checkpoint(path: Path, drop: str) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors[drop]
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("family", "name"),
    [
        ("mamba2", "backbone.layers.1.mixer.A_log"),
        ("bamba", "model.layers.0.mamba.conv1d.weight"),
        ("bamba", "model.layers.1.self_attn.k_proj.weight"),
    ],
)
def test_missing_tensor_is_named(tmp_path: Path, family: str, name: str) -> None:
    make_mamba_checkpoint(tmp_path, family)
    rewrite_checkpoint(tmp_path, name)
    with pytest.raises(ValueError, match=f"missing tensors: {re.escape(name)}$"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_activation_is_named() -> None:
    from extkv.models import Mamba2ForCausalLM

    config = transformers.Mamba2Config(**MAMBA_FAMILIES["mamba2"][2], hidden_act="gelu")
    with pytest.raises(ValueError, match="'gelu'"):
        Mamba2ForCausalLM(config)


# ---------------------------------------------------------------- Triton decode kernels


@dataclass
class DecodeCase:
    """One decode step's mixer inputs over page-strided states (rows of padded pages)."""

    heads: int
    groups: int
    ssm_state: torch.Tensor
    conv_state: torch.Tensor
    xBC: torch.Tensor  # (S, conv_dim), a strided slice of a wider projection as in the mixer
    dt: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    indices: torch.Tensor  # row 1 is padding (-1), row 2 a fresh request (carry False)
    carry: torch.Tensor

    @classmethod
    def random(
        cls,
        heads: int,
        head_dim: int,
        groups: int,
        state: int,
        kernel: int,
        dtype: torch.dtype,
        device: str,
        num_seqs: int = 5,
        num_blocks: int = 12,
    ) -> DecodeCase:
        conv_dim = heads * head_dim + 2 * groups * state
        ssm_page, conv_page = heads * head_dim * state, conv_dim * (kernel - 1)
        pages = torch.randn(num_blocks, ssm_page + 7, device=device)
        conv_pages = torch.randn(num_blocks, conv_page + 3, device=device).to(dtype)
        proj = torch.randn(num_seqs, conv_dim + heads + 9, device=device).to(dtype)
        randn = lambda *shape: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
        indices = torch.randperm(num_blocks)[:num_seqs].to(torch.int32)
        indices[1] = -1  # a padding row
        carry = torch.ones(num_seqs, dtype=torch.bool)
        carry[2] = False  # a fresh request
        return cls(
            heads=heads,
            groups=groups,
            ssm_state=pages[:, :ssm_page].unflatten(1, (heads, head_dim, state)),
            conv_state=conv_pages[:, :conv_page].unflatten(1, (conv_dim, kernel - 1)),
            xBC=proj[:, 5 : 5 + conv_dim],
            dt=proj[:, 5 + conv_dim : 5 + conv_dim + heads],
            weight=randn(conv_dim, kernel),
            bias=randn(conv_dim),
            dt_bias=randn(heads),
            A_log=randn(heads),
            D=randn(heads),
            indices=indices.to(device),
            carry=carry.to(device),
        )

    def split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv output -> x (S, H, P), B and C (S, G, N), as the mixer splits it."""
        n = self.groups * self.ssm_state.shape[-1]
        x, B, C = conv_out.split([conv_out.shape[1] - 2 * n, n, n], dim=-1)
        groups = (self.groups, -1)
        return x.unflatten(1, (self.heads, -1)), B.unflatten(1, groups), C.unflatten(1, groups)


def torch_decode(
    case: DecodeCase, ssm: torch.Tensor, conv: torch.Tensor, limit: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixer's torch path on states ssm, conv: gather the rows, step, scatter the live
    ones back. Returns (conv output, y)."""
    keep = case.indices >= 0
    rows = case.indices.clamp(min=0).long()
    use = (case.carry & keep).view(-1, 1, 1)
    conv_out, conv_new = causal_conv_varlen(
        case.xBC,
        case.weight,
        case.bias,
        torch.where(use, conv[rows], 0.0),
        torch.arange(len(rows) + 1, dtype=torch.int32, device=rows.device),
    )
    x, B, C = case.split(conv_out)
    dt = time_step(case.dt, case.dt_bias, limit)
    A = -torch.exp(case.A_log.float())
    y, ssm_new = ssm_step(torch.where(use[..., None], ssm[rows], 0.0), x, dt, A, B, C, case.D)
    ssm[rows[keep]] = ssm_new[keep]
    conv[rows[keep]] = conv_new[keep].to(conv.dtype)
    return conv_out, y


def reference_decode(case: DecodeCase, limit: tuple[float, float]) -> tuple[torch.Tensor, ...]:
    """`torch_decode` on copies of the states: (conv output, y, ssm state, conv state)."""
    ssm, conv = case.ssm_state.clone(), case.conv_state.clone()
    return (*torch_decode(case, ssm, conv, limit), ssm, conv)


LIMIT = (0.05, 2.0)  # a dt range the random inputs cross on both sides


def triton_decode(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The two kernels as the mixer calls them; returns (conv output, y)."""
    from extkv.kernels.causal_conv import causal_conv_update
    from extkv.kernels.ssd_update import ssm_state_update

    conv_out = causal_conv_update(
        case.xBC, case.conv_state, case.weight, case.bias, case.indices, case.carry
    )
    x, B, C = case.split(conv_out)
    y = ssm_state_update(
        case.ssm_state,
        x,
        case.dt,
        case.dt_bias,
        case.A_log,
        B,
        C,
        case.D,
        case.indices,
        case.carry,
        LIMIT,
    )
    return conv_out, y


def check_decode_kernels(case: DecodeCase, tol: float) -> None:
    want_conv_out, want_y, want_ssm, want_conv = reference_decode(case, LIMIT)
    conv_out, y = triton_decode(case)
    torch.testing.assert_close(conv_out, want_conv_out, rtol=tol, atol=tol)
    torch.testing.assert_close(case.conv_state, want_conv, rtol=tol, atol=tol)
    torch.testing.assert_close(y, want_y, rtol=tol, atol=tol)
    torch.testing.assert_close(case.ssm_state, want_ssm, rtol=tol, atol=tol)


KERNEL_SHAPES = [
    dict(heads=4, head_dim=8, groups=2, state=16, kernel=4),
    dict(heads=3, head_dim=6, groups=1, state=12, kernel=2),  # non-powers of 2, no shift
]


def test_decode_kernels_interpreted() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "kernels"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_gpu(shape: dict, dtype: torch.dtype) -> None:
    case = DecodeCase.random(**shape, dtype=dtype, device="cuda")
    check_decode_kernels(case, tol=2e-2 if dtype != torch.float32 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "overrides"), VARIANTS[::2], ids=VARIANT_IDS[::2])
def test_chunked_prefill_and_decode_match_hf_gpu(
    tmp_path: Path, family: str, overrides: dict
) -> None:
    """The same steps on the GPU, decode through the Triton kernels, against HF on the
    CPU (the attention kernels' fp32 dots run in TF32, hence the looser tolerance)."""
    check_request_steps(tmp_path, family, overrides, "cuda", 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_decode_step_cuda_graph(tmp_path: Path, family: str) -> None:
    """A bf16 decode step captured once and replayed on new inputs equals the eager step:
    logits, states and KV cache; and stays near HF's fp32 logits."""
    hf = make_mamba_checkpoint(tmp_path, family)
    model, _ = load_model(tmp_path, torch.bfloat16, "cuda")
    Bindings(model, "cuda")
    caches = [m.ssm_state for m in mixers(model).values()]
    caches += [m.conv_state for m in mixers(model).values()]
    caches += [t for a in attention_layers(model).values() for t in (a.k_cache, a.v_cache)]
    requests = make_requests()
    n = len(requests)
    want = [hf_logits(hf, r.tokens) for r in requests]

    def run(ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext):
        with torch.inference_mode(), set_forward_context(context):
            return model.compute_logits(model(ids, positions))

    run(*step_inputs(requests, list(PROMPTS), True, "cuda"))
    for r, p in zip(requests, PROMPTS, strict=True):
        r.done = p
    static = step_inputs(requests, [1] * n, False, "cuda", padding=1)
    saved = [t.clone() for t in caches]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(*static)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    for t, s in zip(caches, saved, strict=True):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_logits = run(*static)

    for step in range(DECODE_STEPS):
        ids, positions, context = step_inputs(requests, [1] * n, False, "cuda", padding=1)
        static[0].copy_(ids)
        static[1].copy_(positions)
        for name in ("slot_mapping", "context_lens", "block_tables"):
            getattr(static[2].attention[0], name).copy_(getattr(context.attention[0], name))
        for name in ("state_indices", "has_initial_state"):
            getattr(static[2].mamba, name).copy_(getattr(context.mamba, name))
        before = [t.clone() for t in caches]
        eager = run(ids, positions, context)
        after = [t.clone() for t in caches]
        for t, b in zip(caches, before, strict=True):
            t.copy_(b)
        graph.replay()
        torch.testing.assert_close(graph_logits, eager, rtol=0, atol=0)
        for t, a in zip(caches, after, strict=True):
            assert torch.equal(t, a)
        reference = torch.stack([w[r.done] for w, r in zip(want, requests, strict=True)])
        error = (eager[:n].cpu() - reference).abs().max().item()
        print(f"{family} bf16 decode step {step}: max |logit - HF fp32| = {error:.3f}")
        assert error < 0.1 * reference.abs().max().item()
        for r in requests:
            r.done += 1


if __name__ == "__main__":
    patch_interpreter_masks()
    torch.manual_seed(0)
    for shape in KERNEL_SHAPES:
        check_decode_kernels(DecodeCase.random(**shape, dtype=torch.float32, device="cpu"), 1e-5)
