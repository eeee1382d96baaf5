"""A batch-1 decode step's RMSNorm + linear in one kernel with its weight in registers
(extkv.kernels.norm_linear) against the GEMV it replaces and a reference.

As in test_gated_mlp, the CPU checks run this file as a script under the Triton
interpreter (`TRITON_INTERPRET=1`, in a subprocess); the GPU tests run the kernel eagerly
and replayed in a CUDA graph. It adds up in another order than the GEMV's tiles, so it
is compared within a few roundings of its dtype, against a reference that rounds where
the norm kernel and the GEMV round.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from functools import partial

import pytest
import torch

from extkv.demo import make_random_checkpoint
from extkv.kernels import norm_linear
from extkv.kernels.gemv import num_sms, rms_norm_linear_small_batch
from extkv.kernels.norm_linear import MAX_SLICE_BYTES, RowPlan, plan_for, rms_norm_linear_one_row
from extkv.models import load_model, ops
from helpers import (
    assert_replays_like_eager,
    extkv_logits,
    interpreter_rounds_bf16_to_nearest,
    run_interpreted,
    vary_norms,
)
from test_gated_mlp import DTYPES, TOLERANCE, rms_normed

# (N, K): the qkv projections of Qwen3-0.6B, SmolLM2-135M and a Gemma-3-270M-like
# shape (12 = 8 + 4 rows a program), and scaled down for the interpreter: rows and K in
# one piece or two (128 programs of 2 and 2 + 1 rows, 96 of 1; K 128, 32 + 16).
GPU_SHAPES = ((4096, 1024), (960, 576), (1536, 640))
SMALL_SHAPES = ((256, 128), (96, 48), (384, 48))


def operands(n: int, k: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """One row, a norm weight, and a weight and bias giving unit-size outputs."""
    return {
        "x": (torch.randn(1, k, device=device) * 3).to(dtype),
        "norm_weight": (1 + 0.1 * torch.randn(k, device=device)).to(dtype),
        "weight": (torch.randn(n, k, device=device) * k**-0.5).to(dtype),
        "bias": torch.randn(n, device=device).to(dtype),
    }


def check_one_row(
    n: int,
    k: int,
    dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    with_bias: bool,
    device: str,
) -> None:
    """y within the dtype's tolerance of the reference, the stream exactly residual + x
    (x itself without a residual), the inputs left as they were."""
    o = operands(n, k, dtype, device)
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(1, k, device=device).to(residual_dtype)
    bias = o["bias"] if with_bias else None
    args = (o["x"], residual, o["norm_weight"], 1e-6, o["weight"], bias)
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    y, stream = rms_norm_linear_one_row(*args)
    expected_stream = o["x"] if residual is None else (residual.double() + o["x"].double())
    expected_stream = expected_stream.to(o["x"].dtype if residual is None else residual.dtype)
    expected = rms_normed(expected_stream, o["norm_weight"], 1e-6) @ o["weight"].double().T
    if bias is not None:
        expected = expected + bias.double()
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance)
    assert y.dtype == dtype and y.shape == (1, n)
    assert torch.equal(stream, expected_stream)
    tensors = [(a, b) for a, b in zip(args, before, strict=True) if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in tensors)


def test_row_plan() -> None:
    """The most programs that split the rows evenly into two powers, K in two powers,
    and no plan where a slice would not fit, K is no two powers, or fewer than half the
    SMs would get a program."""
    assert RowPlan.of(4096, 1024, 2, 132) == RowPlan(128, (32, 0), (1024, 0))
    assert RowPlan.of(960, 576, 2, 132) == RowPlan(120, (8, 0), (512, 64))
    assert RowPlan.of(1536, 640, 2, 132) == RowPlan(128, (8, 4), (512, 128))
    assert RowPlan.of(132, 64, 4, 132) == RowPlan(132, (1, 0), (64, 0))
    assert RowPlan.of(4096, 100, 2, 132) is None
    assert RowPlan.of(3, 64, 4, 132) is None  # 3 programs: the GEMV's tiles stream faster
    assert RowPlan.of(132 * 16, 4096, 2, 132) is None  # 16 rows of 4096: 128 KiB a program
    assert MAX_SLICE_BYTES < 16 * 4096 * 2


def test_bad_inputs_are_refused() -> None:
    """Each refusal names the operand and the shape it must have."""
    o = operands(96, 48, torch.float32, "cpu")
    x, nw, w, b = o["x"], o["norm_weight"], o["weight"], o["bias"]
    cases = [
        ((x, None, nw, 1e-6, w[0]), "weight must be (N, K)"),
        ((x.repeat(2, 1), None, nw, 1e-6, w), "x must be one row (1, 48)"),
        ((x, x[:, 1:], nw, 1e-6, w), "residual must be (1, 48)"),
        ((x, None, nw[1:], 1e-6, w), "norm_weight must be (48,)"),
        ((x, None, nw, 1e-6, w, b[1:]), "bias must be (96,)"),
        ((x, None, nw, 1e-6, w.t().contiguous().t()), "needs contiguous operands"),
        ((x, None, nw, 1e-6, w.half()), "weight's dtype torch.float16 must be x's"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            rms_norm_linear_one_row(*args)
    big = operands(96, 100, torch.float32, "cpu")  # K 100 is no two powers: no plan
    with pytest.raises(ValueError, match="96 x 100 does not fit in registers"):
        rms_norm_linear_one_row(big["x"], None, big["norm_weight"], 1e-6, big["weight"])
    few = operands(3, 64, torch.float32, "cpu")  # 3 rows: 3 programs, under half the SMs
    with pytest.raises(ValueError, match=r"3 x 64 does not fit .* at least half the SMs"):
        rms_norm_linear_one_row(few["x"], None, few["norm_weight"], 1e-6, few["weight"])


# ---------------------------------------------------------------- CPU: Triton interpreter


def check_qkv_through_the_model() -> None:
    """A 3-layer model's logits for one row are the same (fp32, to rounding) whichever
    EXTKV_PERSISTENT runs them: at 1 each layer's norm + qkv takes the kernel, at 0 none
    does (nor ever the MLP's gate_up, which asks for no `one_row`). CPU rows are let into
    the decode GEMV's path, which the interpreter runs, by `takes_gemv`."""
    gemv_rows, kernel = ops.takes_gemv, norm_linear.rms_norm_linear_one_row
    ops.takes_gemv = lambda x, w: (
        gemv_rows(x, w)
        or (x.dim() == 2 and x.shape[0] == 1 and x.dtype == w.dtype == torch.float32)
    )
    calls = []
    norm_linear.rms_norm_linear_one_row = lambda *a: calls.append(a[4].shape) or kernel(*a)
    with tempfile.TemporaryDirectory() as folder:
        path = make_random_checkpoint(folder, "qwen3", with_tokenizer=False, num_hidden_layers=3)
        model = load_model(path, torch.float32, torch.device("cpu"))[0]
    vary_norms(model)
    qkv_rows = model.model.layers[0].self_attn.qkv_proj.weight.shape
    logits = {}
    try:
        for level in ("0", "1"):
            os.environ["EXTKV_PERSISTENT"] = level
            calls.clear()
            logits[level] = extkv_logits(model, [torch.tensor([5])])
            assert calls == {"0": [], "1": [qkv_rows] * 3}[level], calls
    finally:
        ops.takes_gemv, norm_linear.rms_norm_linear_one_row = gemv_rows, kernel
        del os.environ["EXTKV_PERSISTENT"]
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-4, atol=1e-4)


def interpreter_checks() -> list[Callable[[], None]]:
    return [
        check_qkv_through_the_model,
        *(
            partial(check_one_row, *shape, dtype, residual_dtype, with_bias, "cpu")
            for shape in SMALL_SHAPES
            for dtype, residual_dtype in DTYPES
            for with_bias in (False, True)
        ),
    ]


def test_interpreted() -> None:
    run_interpreted(__file__)


# ---------------------------------------------------------------- GPU

kernel = rms_norm_linear_one_row  # the kernel itself, where a test spies on its name


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_rms_norm_linear_one_row_gpu(shape: tuple[int, int]) -> None:
    o = operands(*shape, torch.bfloat16, "cuda")
    plan = plan_for(o["x"], o["weight"])
    assert plan is not None and plan.programs <= num_sms(torch.device("cuda"))
    for residual_dtype in (torch.bfloat16, torch.float32, None):
        for with_bias in (False, True):
            check_one_row(*shape, torch.bfloat16, residual_dtype, with_bias, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_ops_take_the_kernel_at_one_row_gpu(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ops.rms_norm_linear runs the kernel for one row with `one_row` (its bits) at
    EXTKV_PERSISTENT=1, and the GEMV (its bits, the kernel never called) without
    `one_row`, at 0, and for two rows."""
    o = operands(*shape, torch.bfloat16, "cuda")
    residual = torch.randn_like(o["x"])
    args = (o["x"], residual, o["norm_weight"], 1e-6, o["weight"], o["bias"])
    two = (o["x"].repeat(2, 1), residual.repeat(2, 1), *args[2:])
    calls = []
    monkeypatch.setattr(
        norm_linear, "rms_norm_linear_one_row", lambda *a: calls.append(1) or kernel(*a)
    )
    monkeypatch.setenv("EXTKV_PERSISTENT", "1")
    assert all(map(torch.equal, ops.rms_norm_linear(*args, one_row=True), kernel(*args)))
    assert calls == [1]
    for level, rows, one_row in (("1", args, False), ("1", two, True), ("0", args, True)):
        monkeypatch.setenv("EXTKV_PERSISTENT", level)
        gemv = rms_norm_linear_small_batch(*rows)
        assert all(map(torch.equal, ops.rms_norm_linear(*rows, one_row=one_row), gemv))
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_cuda_graph_replay_gpu(shape: tuple[int, int]) -> None:
    """Captured once, replayed over new inputs: the eager kernel's bits every time."""
    o = operands(*shape, torch.bfloat16, "cuda")
    weights = (o["norm_weight"], 1e-6, o["weight"], o["bias"])
    inputs = [o["x"].clone(), torch.randn_like(o["x"])]  # the row, the residual
    assert_replays_like_eager(
        lambda x, residual: rms_norm_linear_one_row(x, residual, *weights), inputs
    )


if __name__ == "__main__":
    interpreter_rounds_bf16_to_nearest()
    for check in interpreter_checks():
        torch.manual_seed(0)
        check()
