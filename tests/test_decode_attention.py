"""The decode step's attention sublayer in one persistent kernel
(extkv.kernels.decode_attention) against the kernels it replaces, bit for bit: the
norm-fused qkv GEMV, q/k norm + rotary + KV store, and paged attention with its merge.

As in test_gemv, the CPU checks run this file as a script under the Triton interpreter
(`TRITON_INTERPRET=1`, in a subprocess), where the kernel launches once per stage; the
GPU tests run its one launch, barriers included, eagerly and replayed in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from extkv.attention import AttentionMetadata
from extkv.kernels.decode_attention import decode_attention_block
from extkv.kernels.gemv import MAX_ROWS, rms_norm_linear_small_batch
from extkv.kernels.paged_attention import paged_attention
from extkv.kernels.rotary import qk_norm_rope_store
from helpers import (
    LAYOUTS,
    Cache,
    interpreter_dots_bf16_as_numbers,
    interpreter_rounds_bf16_to_nearest,
    run_interpreted,
)


@dataclass(frozen=True)
class Shape:
    """An attention sublayer's shape."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: bool
    bias: bool = False


QWEN3 = Shape(1024, 16, 8, 128, 128, True)
LLAMA_SMALL = Shape(576, 9, 3, 64, 64, False)  # SmolLM2-135M's
SMALL = (Shape(64, 4, 1, 16, 16, True), Shape(48, 6, 2, 16, 8, False, bias=True))


def decode_metadata(
    context_lens: list[int], block_size: int, width: int, device: str
) -> AttentionMetadata:
    """One token per sequence, sequence s on blocks s * width ... (its last token new)."""
    num_seqs = len(context_lens)
    tables = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
    last = torch.tensor(context_lens) - 1
    slots = tables[torch.arange(num_seqs), last // block_size].long() * block_size
    return AttentionMetadata(
        is_prefill=False,
        slot_mapping=(slots + last % block_size).to(device),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_seqlen_q=1,
        max_context_len=width * block_size,
    )


@dataclass
class Step:
    """A decode step's inputs to one attention sublayer, and the layer's weights."""

    shape: Shape
    x: torch.Tensor
    residual: torch.Tensor | None
    norm_weight: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    cache: Cache
    metadata: AttentionMetadata

    @classmethod
    def random(
        cls,
        shape: Shape,
        num_seqs: int,
        layout: str,
        dtype: torch.dtype,
        device: str,
        width: int,
        residual_dtype: torch.dtype | None = None,
    ) -> Step:
        block_size = 16
        context_lens = torch.randint(1, width * block_size + 1, (num_seqs,)).tolist()
        context_lens[0] = width * block_size  # one sequence sees every key
        metadata = decode_metadata(context_lens, block_size, width, device)
        heads = shape.q_heads + 2 * shape.kv_heads

        def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*size, device=device) * scale).to(dtype)

        def norm_weight(size: int) -> torch.Tensor:
            return (1 + 0.1 * torch.randn(size, device=device)).to(dtype)

        x = torch.randn(MAX_ROWS, shape.hidden + 3, dtype=dtype, device=device)
        residual = None
        if residual_dtype is not None:
            residual = torch.randn(num_seqs, shape.hidden, dtype=residual_dtype, device=device)
        qk_norm = (norm_weight(shape.head_dim), norm_weight(shape.head_dim))
        page = (block_size, shape.kv_heads, shape.head_dim)
        return cls(
            shape,
            x[:num_seqs, : shape.hidden],
            residual,
            norm_weight(shape.hidden),
            randn(heads * shape.head_dim, shape.hidden, scale=shape.hidden**-0.5),
            randn(heads * shape.head_dim) if shape.bias else None,
            metadata.context_lens.long() - 1,
            torch.randn(width * block_size, shape.rotary_dim, device=device),
            *(qk_norm if shape.qk_norm else (None, None)),
            Cache.random(layout, num_seqs * width, *page, dtype, device),
            metadata,
        )

    def fused(
        self, window: int | None = None, stages: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        return decode_attention_block(
            self.x, self.residual, self.norm_weight, 1e-6, self.qkv_weight, self.qkv_bias,
            self.positions, self.cos_sin, s.q_heads, s.kv_heads, self.q_norm, self.k_norm,
            1e-5, self.cache.k, self.cache.v, self.metadata, s.head_dim**-0.5, window,
            num_stages=stages,
        )  # fmt: skip

    def separate(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels the persistent one replaces, one after the other."""
        s = self.shape
        qkv, stream = rms_norm_linear_small_batch(
            self.x, self.residual, self.norm_weight, 1e-6, self.qkv_weight, self.qkv_bias
        )
        q = qk_norm_rope_store(
            qkv, self.positions, self.cos_sin, s.q_heads, s.kv_heads, self.q_norm, self.k_norm,
            1e-5, self.cache.k, self.cache.v, self.metadata.slot_mapping,
        )  # fmt: skip
        scale = s.head_dim**-0.5
        out = paged_attention(
            q, self.cache.k, self.cache.v, self.metadata, scale, sliding_window=window
        )
        return out, stream


def check_decode_attention(
    shape: Shape,
    num_seqs: int,
    layout: str,
    dtype: torch.dtype,
    device: str,
    width: int,
    residual_dtype: torch.dtype | None = None,
    window: int | None = None,
) -> None:
    """The separate kernels' output, residual stream and cache bit for bit; the residual
    given is left as it was."""
    step = Step.random(shape, num_seqs, layout, dtype, device, width, residual_dtype)
    before = step.cache.buf.clone()
    residual = None if step.residual is None else step.residual.clone()
    out, stream = step.fused(window)
    fused_cache = step.cache.buf.clone()
    step.cache.buf.copy_(before)
    expected, expected_stream = step.separate(window)
    assert torch.equal(out, expected)
    assert torch.equal(stream, expected_stream)
    assert torch.equal(fused_cache, step.cache.buf) and not torch.equal(fused_cache, before)
    if residual is not None:
        assert torch.equal(step.residual, residual)


def test_bad_inputs_are_refused() -> None:
    """A prefill's metadata, a qkv weight of the wrong height and a bad rotary table are
    refused, naming what they must be."""
    step = Step.random(SMALL[0], 2, "split", torch.float32, "cpu", 4)
    with pytest.raises(ValueError, match="a decode step's metadata, got a prefill's"):
        step.metadata.is_prefill = True
        step.fused()
    step.metadata.is_prefill = False
    step.qkv_weight = step.qkv_weight[1:]
    with pytest.raises(ValueError, match=re.escape("qkv_weight must have (num_q_heads 4")):
        step.fused()
    step = Step.random(SMALL[0], 2, "split", torch.float32, "cpu", 4)
    step.cos_sin = step.cos_sin[:, :3]
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        step.fused()
    step = Step.random(SMALL[1], 2, "split", torch.float32, "cpu", 4)  # 6 q heads, 2 KV heads
    step.shape = dataclasses.replace(step.shape, kv_heads=4)
    with pytest.raises(ValueError, match=re.escape("num_q_heads (6) must be a multiple of")):
        step.fused()
    step = Step.random(SMALL[0], 2, "split", torch.float32, "cpu", 4)
    step.metadata.block_tables = step.metadata.block_tables.t().contiguous().t()
    with pytest.raises(ValueError, match="block_tables must have contiguous rows"):
        step.fused()
    with pytest.raises(ValueError, match="num_stages must be a positive int or None, got 0"):
        Step.random(SMALL[0], 2, "split", torch.float32, "cpu", 4).fused(stages=0)


# ---------------------------------------------------------------- CPU: Triton interpreter


def interpreter_checks() -> list[Callable[[], None]]:
    # One sequence over 8 blocks splits its keys in two on the interpreter's one SM;
    # three sequences do not split.
    return [
        partial(check_decode_attention, shape, num_seqs, layout, dtype, "cpu", 8, residual_dtype)
        for shape in SMALL
        for num_seqs in (1, 3)
        for layout in LAYOUTS
        for dtype, residual_dtype in ((torch.float32, torch.float32), (torch.bfloat16, None))
    ] + [partial(check_decode_attention, SMALL[0], 1, "split", torch.float32, "cpu", 8, None, 40)]


def test_interpreted() -> None:
    run_interpreted(__file__, timeout=900)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_seqs", [1, 4, 16])
@pytest.mark.parametrize("shape", [QWEN3, LLAMA_SMALL], ids=["qwen3", "smollm2"])
def test_decode_attention_gpu(shape: Shape, num_seqs: int, layout: str) -> None:
    for residual_dtype in (torch.bfloat16, None):
        check_decode_attention(shape, num_seqs, layout, torch.bfloat16, "cuda", 32, residual_dtype)
    check_decode_attention(shape, num_seqs, layout, torch.bfloat16, "cuda", 32, window=100)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_depth_keeps_the_bits_gpu(stages: int) -> None:
    """`stages` changes how deep the qkv loop pipelines, not what it adds up."""
    step = Step.random(QWEN3, 4, "split", torch.bfloat16, "cuda", 32, torch.bfloat16)
    before = step.cache.buf.clone()
    expected = step.fused()
    step.cache.buf.copy_(before)
    assert all(map(torch.equal, step.fused(stages=stages), expected))


@pytest.mark.gpu
def test_cuda_graph_replay_gpu() -> None:
    """Captured once, replayed over new inputs: the separate kernels' bits every time."""
    static = Step.random(QWEN3, 4, "block_major", torch.bfloat16, "cuda", 32, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, and make the barrier counter, outside the capture
        static.fused()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, stream = static.fused()
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        static.x.copy_(torch.randn_like(static.x))
        static.residual.copy_(torch.randn_like(static.residual))
        before = static.cache.buf.clone()
        graph.replay()
        replayed = static.cache.buf.clone()
        static.cache.buf.copy_(before)
        expected, expected_stream = static.separate()
        assert torch.equal(out, expected) and torch.equal(stream, expected_stream)
        assert torch.equal(replayed, static.cache.buf)


if __name__ == "__main__":
    interpreter_rounds_bf16_to_nearest()
    interpreter_dots_bf16_as_numbers()
    for check in interpreter_checks():
        torch.manual_seed(0)
        check()
    sys.exit(0)
