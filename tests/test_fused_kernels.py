"""The fused decode kernels (norms, SiLU*mul, q/k norm + rotary + KV store) against the
torch references of extkv.models.reference, and the kernel count of a decode step.

As in test_kernels, the CPU checks run this file as a script under the Triton
interpreter (`TRITON_INTERPRET=1`, in a subprocess); the GPU tests run the
compiled kernels. Low-precision results must round where torch's ops do: beyond
the dtype's tolerance, at most 1% of the elements may differ at all (sums taken
in another order flip a rare rounding), which a kernel rounding at other points
than torch would exceed.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch

from extkv.attention import Attention, AttentionMetadata, ForwardContext, set_forward_context
from extkv.demo import QWEN3_0_6B_SHAPE, make_random_checkpoint
from extkv.kernels.activation import silu_and_mul
from extkv.kernels.argmax import logits_and_argmax
from extkv.kernels.norm import gated_rms_norm, rms_norm
from extkv.kernels.pending_tokens import pending_tokens
from extkv.kernels.rotary import qk_norm_rope, qk_norm_rope_store
from extkv.models import load_model, reference
from extkv.models.layers import RotaryEmbedding
from helpers import (
    LAYOUTS,
    Cache,
    interpreter_rounds_bf16_to_nearest,
    run_interpreted,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# fp16 keeps 3 more mantissa bits than bf16, so one rounding step apart (a sum taken in
# another order) already exceeds torch's default fp16 tolerance; allow two fp16 ulps.
TOLERANCES = {torch.float16: dict(rtol=2 * 2**-10, atol=1e-5)}


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within the dtype's tolerance, and rounded as the reference (see the module doc)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOLERANCES.get(ref.dtype, {}))
    if ref.dtype != torch.float32:
        differ = (out != ref).float().mean().item()
        assert differ <= 0.01, f"{differ:.1%} of the elements round differently"


def check_rms_norm(
    hidden: int, dtype: torch.dtype, device: str, residual_dtype: torch.dtype | None = None
) -> None:
    """Without a residual; with one (updated in place, rows of a wider tensor); with an
    fp32 residual stream under a low-precision x (Mamba2's residual_in_fp32)."""
    rows = 7
    x = torch.randn(rows, hidden + 3, dtype=dtype, device=device)[:, :hidden]
    weight = torch.randn(hidden, dtype=dtype, device=device)
    assert_matches(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    residual = torch.randn(rows, hidden, dtype=residual_dtype or dtype, device=device)
    expected_residual = residual.clone()
    out, updated = rms_norm(x, weight, 1e-5, residual)
    expected = reference.rms_norm(x, weight, 1e-5, expected_residual)[0]
    assert updated is residual
    assert_matches(residual, expected_residual)
    assert_matches(out, expected)


def check_silu_and_mul(inner: int, dtype: torch.dtype, device: str) -> None:
    gate_up = torch.randn(5, 2 * inner, dtype=dtype, device=device) * 4
    assert_matches(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


def check_gated_rms_norm(dim: int, group_size: int, dtype: torch.dtype, device: str) -> None:
    """y in fp32 (the SSM output), gate a strided column slice (of in_proj's output)."""
    y = torch.randn(6, dim, device=device)
    gate = torch.randn(6, 3 * dim, dtype=dtype, device=device)[:, dim : 2 * dim]
    weight = torch.randn(dim, dtype=dtype, device=device)
    assert_matches(
        gated_rms_norm(y, gate, weight, group_size, 1e-5),
        reference.gated_rms_norm(y, gate, weight, group_size, 1e-5),
    )


def rotary_table(head_dim: int, rotary_dim: int, device: str) -> torch.Tensor:
    params = {"rope_type": "default", "rope_theta": 10000.0}
    params["partial_rotary_factor"] = rotary_dim / head_dim
    return RotaryEmbedding(head_dim, 300, params).cos_sin_cache.to(device)


@dataclass(frozen=True)
class RopeCase:
    """The shapes and settings of one q/k norm + rotary check."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: bool
    dtype: torch.dtype
    device: str

    def inputs(self, num_tokens: int) -> tuple:
        """Arguments up to the cache: qkv rows of a wider tensor, scattered positions."""
        width = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        qkv = torch.randn(num_tokens, width + 8, dtype=self.dtype, device=self.device)[:, :width]
        positions = torch.randint(0, 300, (num_tokens,), device=self.device)
        weights = [torch.randn(self.head_dim, dtype=self.dtype, device=self.device) for _ in "qk"]
        return (
            qkv,
            positions,
            rotary_table(self.head_dim, self.rotary_dim, self.device),
            self.num_q_heads,
            self.num_kv_heads,
            *(weights if self.qk_norm else (None, None)),
            1e-6,
        )


def check_qk_norm_rope_store(
    layout: str, case: RopeCase, block_size: int = 4, with_keys: bool = False
) -> None:
    """q, and the whole cache buffer: written slots match, padding (-1) slots and page
    padding stay as they were. `with_keys`: k also comes back in a tensor of its own (the
    prefill kernel's input), every token's, padding ones included."""
    num_tokens, num_blocks = 11, 6
    args = case.inputs(num_tokens)
    cache = Cache.random(
        layout, num_blocks, block_size, case.num_kv_heads, case.head_dim, case.dtype, case.device
    )
    slots = torch.randperm(num_blocks * block_size, device=case.device)[:num_tokens]
    slots[::4] = -1
    expected = cache.rebased(cache.buf.clone())
    q_ref = reference.qk_norm_rope_store(*args, expected.k, expected.v, slots)
    keys = None
    if with_keys:
        keys = torch.full((num_tokens, case.num_kv_heads, case.head_dim), float("nan"))
        keys = keys.to(case.dtype).to(case.device)
    q = qk_norm_rope_store(*args, cache.k, cache.v, slots, keys)
    assert_matches(q, q_ref)
    assert_matches(cache.buf, expected.buf)
    if with_keys:
        assert_matches(keys, reference.qk_norm_rope(*args)[1])


def check_qk_norm_rope(case: RopeCase) -> None:
    """No cache (the profiling run): q, k and v come back as tensors."""
    args = case.inputs(9)
    for out, ref in zip(qk_norm_rope(*args), reference.qk_norm_rope(*args), strict=True):
        assert_matches(out, ref)


def check_logits_and_argmax(vocab: int, dtype: torch.dtype, device: str) -> None:
    """The fp32 copy and torch.argmax's token, bit for bit, on rows that pick out its
    rules: a tie across blocks and one inside a block (the first column wins), NaNs (the
    first NaN wins), a row of -inf; twice, as a graph replays it."""
    logits = (torch.randn(6, vocab + 3, device=device) * 4).to(dtype)[:, :vocab]
    top = torch.finfo(dtype).max
    logits[1, [vocab - 5, vocab // 2]] = top  # the same maximum in two blocks
    logits[2, [7, 9]] = top  # twice in one block
    logits[3, [vocab - 2, vocab // 3]] = float("nan")
    logits[4] = float("-inf")
    want = [vocab // 2, 7, vocab // 3, 0]  # rows 1-4's tokens
    for _ in range(2):
        out = torch.full((6, vocab), 7.0, device=device)
        tokens = torch.full((6,), -1, dtype=torch.int64, device=device)
        logits_and_argmax(logits, out, tokens)
        torch.testing.assert_close(out, logits.float(), rtol=0, atol=0, equal_nan=True)
        assert tokens.tolist() == logits.float().argmax(-1).tolist()
        assert tokens[1:5].tolist() == want
        logits, want = logits.flip(0), want[::-1]  # new rows for the counters' second use


def check_pending_tokens(rows: int, device: str) -> None:
    """Rows from the device's last tokens where their source is >= 0, staged ids elsewhere."""
    gen = torch.Generator().manual_seed(rows)
    input_ids = torch.randint(0, 1000, (rows,), generator=gen, dtype=torch.int32).to(device)
    last_tokens = torch.randint(0, 1000, (rows + 3,), generator=gen, dtype=torch.int32).to(device)
    sources = torch.randint(-1, rows + 3, (rows,), generator=gen, dtype=torch.int32).to(device)
    want = torch.where(sources >= 0, last_tokens[sources.clamp(min=0).long()], input_ids)
    assert torch.equal(pending_tokens(input_ids, sources, last_tokens), want)


def test_pending_tokens_refuses_bad_inputs() -> None:
    ids = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"input_ids and sources must be one \(T,\) shape"):
        pending_tokens(ids, torch.zeros(3, dtype=torch.int32), ids)
    with pytest.raises(ValueError, match=r"last_tokens' dtype torch\.int64 must be input_ids'"):
        pending_tokens(ids, ids, ids.long())


def test_logits_and_argmax_refuses_bad_outputs() -> None:
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="out must be fp32"):
        logits_and_argmax(logits, torch.empty(2, 10, dtype=torch.bfloat16), torch.empty(2))
    with pytest.raises(ValueError, match=r"tokens must be contiguous integers of shape \(2,\)"):
        logits_and_argmax(logits, torch.empty(2, 10), torch.empty(2))
    with pytest.raises(ValueError, match="tokens must be contiguous"):
        logits_and_argmax(logits, torch.empty(2, 10), torch.empty(2, 2, dtype=torch.long)[:, 0])
    with pytest.raises(ValueError, match="logits must be float32, bfloat16 or float16"):
        logits_and_argmax(logits.double(), torch.empty(2, 10), torch.empty(2, dtype=torch.long))


def test_bad_shapes_are_refused() -> None:
    cos_sin = rotary_table(32, 32, "cpu")
    qkv = torch.randn(3, 6 * 32 + 1)
    with pytest.raises(ValueError, match="qkv must be"):
        qk_norm_rope(qkv, torch.zeros(3, dtype=torch.long), cos_sin, 4, 2, None, None, 1e-6)
    with pytest.raises(ValueError, match="even rotary_dim"):
        qk_norm_rope(
            qkv[:, 1:], torch.zeros(3, dtype=torch.long), cos_sin[:, :5], 4, 1, None, None, 0
        )
    with pytest.raises(ValueError, match=r"keys must be \(3, 1, 32\) with contiguous"):
        k_cache = torch.empty(2, 4, 1, 32)
        slots = torch.zeros(3, dtype=torch.long)
        qk = (qkv[:, 1:], torch.zeros(3, dtype=torch.long), cos_sin, 4, 1, None, None, 0)
        qk_norm_rope_store(*qk, k_cache, k_cache, slots, torch.empty(3, 2, 32))
    with pytest.raises(ValueError, match=r"\(T, 2I\)"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="group_size 5 must divide"):
        gated_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 5, 1e-5)


# ---------------------------------------------------------------- CPU: Triton interpreter


def interpreter_checks() -> dict[str, list[Callable[[], None]]]:
    every = [(dtype, "cpu") for dtype in DTYPES]
    return {
        "norms": [
            *(partial(check_rms_norm, hidden, *on) for hidden in (1024, 100) for on in every),
            partial(check_rms_norm, 96, torch.bfloat16, "cpu", residual_dtype=torch.float32),
            *(partial(check_gated_rms_norm, 96, group, *on) for group in (96, 24) for on in every),
        ],
        "step": [
            *(partial(check_logits_and_argmax, 10_000, *on) for on in every),
            *(partial(check_pending_tokens, rows, "cpu") for rows in (1, 1500)),
        ],
        "silu_and_mul": [
            partial(check_silu_and_mul, inner, *on) for inner in (77, 1100) for on in every
        ],
        "rotary": [
            *(
                partial(
                    check_qk_norm_rope_store, layout, RopeCase(4, 2, 32, 32, True, dtype, "cpu")
                )
                for layout in LAYOUTS
                for dtype in DTYPES
            ),
            *(
                partial(
                    check_qk_norm_rope_store,
                    "split",
                    RopeCase(4, 2, 32, 32, True, dtype, "cpu"),
                    with_keys=True,
                )
                for dtype in DTYPES
            ),
            # odd heads, partial, odd dim
            partial(
                check_qk_norm_rope_store,
                "split",
                RopeCase(3, 1, 24, 12, False, torch.bfloat16, "cpu"),
                with_keys=True,
            ),
            partial(
                check_qk_norm_rope_store,
                "hybrid",
                RopeCase(8, 8, 64, 32, False, torch.float16, "cpu"),
                block_size=16,
            ),
            *(
                partial(check_qk_norm_rope, RopeCase(4, 2, 32, 16, norm, *on))
                for norm in (False, True)
                for on in every
            ),
        ],
    }


@pytest.mark.parametrize("kernels", ["norms", "silu_and_mul", "rotary", "step"])
def test_interpreted(kernels: str) -> None:
    run_interpreted(__file__, kernels)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1024, 4096, 1000])
def test_norms_gpu(hidden: int, dtype: torch.dtype) -> None:
    check_rms_norm(hidden, dtype, "cuda")
    check_gated_rms_norm(hidden, hidden // 4, dtype, "cuda")


@pytest.mark.gpu
def test_rms_norm_fp32_residual_gpu() -> None:
    check_rms_norm(2048, torch.bfloat16, "cuda", residual_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [3072, 1111])
def test_silu_and_mul_gpu(inner: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(inner, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("heads", "head_dim", "rotary_dim", "qk_norm"),
    [
        ((16, 8), 128, 128, True),
        ((32, 8), 64, 64, False),
        ((6, 2), 128, 64, False),
        ((5, 1), 80, 40, True),
    ],
    ids=["qwen3", "llama", "bamba-partial", "odd"],
)
@pytest.mark.parametrize("with_keys", [False, True])
def test_qk_norm_rope_store_gpu(
    layout: str,
    heads: tuple[int, int],
    head_dim: int,
    rotary_dim: int,
    qk_norm: bool,
    dtype: torch.dtype,
    with_keys: bool,
) -> None:
    case = RopeCase(*heads, head_dim, rotary_dim, qk_norm, dtype, "cuda")
    check_qk_norm_rope_store(layout, case, block_size=16, with_keys=with_keys)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_no_cache_gpu(qk_norm: bool) -> None:
    check_qk_norm_rope(RopeCase(16, 8, 128, 64, qk_norm, torch.bfloat16, "cuda"))


def qwen3_shaped(folder: Path, num_layers: int) -> torch.nn.Module:
    """Qwen3-0.6B's layer shapes (a small vocabulary), random weights, loaded in bf16."""
    shape = {**QWEN3_0_6B_SHAPE, "vocab_size": 1024, "num_hidden_layers": num_layers}
    make_random_checkpoint(folder, "qwen3", with_tokenizer=False, dtype=torch.bfloat16, **shape)
    return load_model(folder, torch.bfloat16, torch.device("cuda"))[0]


def bind_cache(model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
    """A block_major cache per attention layer, as the engine binds it."""
    for layer in model.modules():
        if isinstance(layer, Attention):
            page = (block_size, layer.num_kv_heads, layer.head_dim)
            buf = torch.randn(num_blocks, 2, *page, dtype=torch.bfloat16, device="cuda")
            layer.k_cache, layer.v_cache = buf[:, 0], buf[:, 1]


def decode_metadata(context_lens: list[int], block_size: int, width: int) -> AttentionMetadata:
    """One token per sequence, sequence s on blocks s * width ... (its last token new)."""
    num_seqs = len(context_lens)
    tables = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
    last = torch.tensor(context_lens) - 1
    slots = tables[torch.arange(num_seqs), last // block_size].long() * block_size
    return AttentionMetadata(
        is_prefill=False,
        slot_mapping=(slots + last % block_size).cuda(),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        max_seqlen_q=1,
        max_context_len=width * block_size,
    )


def decode_step_kernels(folder: Path, num_layers: int, num_seqs: int) -> Counter[str]:
    """Device activities (kernels, copies, memsets) of one eager decode step of `num_seqs`
    (at most 4) sequences, by name: the same kernels a captured graph replays."""
    block_size, width = 16, 16
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    model = qwen3_shaped(folder, num_layers)
    bind_cache(model, num_seqs * width, block_size)
    context_lens = [5, 17, 100, 256][-num_seqs:]
    metadata = decode_metadata(context_lens, block_size, width)
    ids = torch.randint(0, 1024, (num_seqs,), device="cuda")
    positions = torch.tensor(context_lens, device="cuda") - 1
    with torch.inference_mode(), set_forward_context(ForwardContext((metadata,))):
        model(ids, positions)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            model(ids, positions)
            torch.cuda.synchronize()
    return Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_and_argmax_gpu(dtype: torch.dtype) -> None:
    check_logits_and_argmax(151_936, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256, 3000])
def test_pending_tokens_gpu(rows: int) -> None:
    check_pending_tokens(rows, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("persistent", "attention", "num_seqs", "most"),
    [
        ("0", "0", 1, 7),
        ("0", "1", 4, 5),
        ("1", "0", 4, 7),
        ("1", "0", 1, 5),
        ("1", "1", 1, 3),
    ],
)
def test_decode_kernels_per_layer(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    persistent: str,
    attention: str,
    num_seqs: int,
    most: int,
) -> None:
    """Kernels per decoder layer. With the GEMVs and EXTKV_DECODE_ATTENTION=0, at most 7:
    qkv (norm + residual add fused in), q/k norm + rotary + KV store, attention (2:
    split-K and merge), o_proj, gate_up (norm + add fused in), down (SiLU*mul fused in).
    The decode attention kernel (EXTKV_DECODE_ATTENTION=1, the default) makes the second
    to fourth one. One sequence with EXTKV_PERSISTENT=1 (the default): the last three are
    the one-row MLP kernel, so a layer is 3 kernels. Counted as the difference between a
    4- and a 2-layer model, so the embedding and final norm are left out."""
    monkeypatch.setenv("EXTKV_PERSISTENT", persistent)
    monkeypatch.setenv("EXTKV_DECODE_ATTENTION", attention)
    four = decode_step_kernels(tmp_path / "4", 4, num_seqs)
    two = decode_step_kernels(tmp_path / "2", 2, num_seqs)
    per_layer = (four.total() - two.total()) / 2
    print(f"\ndecode step: {per_layer:g} kernels per decoder layer")
    assert per_layer <= most, f"{per_layer} kernels per decoder layer; two layers add {four - two}"


@dataclass
class DecodeStep:
    """A decoder layer's inputs for one decode step."""

    metadata: AttentionMetadata
    hidden: torch.Tensor
    residual: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def random(cls, seed: int, num_seqs: int, block_size: int, width: int) -> DecodeStep:
        torch.manual_seed(seed)
        context_lens = torch.randint(1, width * block_size, (num_seqs,)).tolist()
        metadata = decode_metadata(context_lens, block_size, width)
        hidden, residual = torch.randn(2, num_seqs, 1024, dtype=torch.bfloat16, device="cuda")
        return cls(metadata, hidden, residual, metadata.context_lens.long() - 1)

    def copy_(self, other: DecodeStep) -> None:
        """Take `other`'s values (block tables are the same: sizes only)."""
        for name in ("slot_mapping", "context_lens"):
            getattr(self.metadata, name).copy_(getattr(other.metadata, name))
        for name in ("hidden", "residual", "positions"):
            getattr(self, name).copy_(getattr(other, name))


@pytest.mark.gpu
@pytest.mark.parametrize(("persistent", "num_seqs"), [("0", 4), ("1", 4), ("0", 1), ("1", 1)])
def test_decoder_layer_cuda_graph_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persistent: str, num_seqs: int
) -> None:
    """One captured decoder layer replayed over new inputs equals the eager layer: the
    residual stream, K/V written through the slots, q/k normed and rotated; with the
    GEMVs and (one sequence, EXTKV_PERSISTENT=1) the one-row MLP and norm + qkv kernels."""
    monkeypatch.setenv("EXTKV_PERSISTENT", persistent)
    block_size, width = 16, 8
    model = qwen3_shaped(tmp_path, 1)
    bind_cache(model, num_seqs * width, block_size)
    layer, attn = model.model.layers[0], model.model.layers[0].self_attn.attn
    cos_sin = model.model.rotary_emb.cos_sin_cache

    def run(step: DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
        with set_forward_context(ForwardContext((step.metadata,))):
            return layer(step.hidden, step.residual, step.positions, cos_sin)

    static = DecodeStep.random(0, num_seqs, block_size, width)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(static)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, residual = run(static)

        for seed in (1, 2, 3):
            new = DecodeStep.random(seed, num_seqs, block_size, width)
            static.copy_(new)  # before the eager run updates new.residual
            before = attn.k_cache.clone(), attn.v_cache.clone()
            want_out, want_residual = run(new)
            want_cache = attn.k_cache.clone(), attn.v_cache.clone()
            attn.k_cache.copy_(before[0])
            attn.v_cache.copy_(before[1])
            graph.replay()
            assert torch.equal(out, want_out)
            assert torch.equal(residual, want_residual)
            assert torch.equal(attn.k_cache, want_cache[0])
            assert torch.equal(attn.v_cache, want_cache[1])
            assert not torch.equal(attn.k_cache, before[0])  # the step wrote its K


if __name__ == "__main__":
    interpreter_rounds_bf16_to_nearest()
    for check in interpreter_checks()[sys.argv[1]]:
        torch.manual_seed(0)
        check()
