"""A batch-1 decode step's MLP sublayer in one kernel with its weights in registers
(extkv.kernels.gated_mlp) against the ops it replaces, and the grid barrier it stands on.

As in test_gemv, the CPU checks run this file as a script under the Triton interpreter
(`TRITON_INTERPRET=1`, in a subprocess), where the kernel launches once per stage; the
GPU tests run its one launch, barriers included, eagerly and replayed in a CUDA graph.
The kernel adds up in another order than the GEMVs' tiles, so it is compared within a
few roundings of its dtype, against a reference that rounds where the ops round.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from functools import partial

import pytest
import torch
import triton
import triton.language as tl

from extkv.demo import make_random_checkpoint
from extkv.kernels import gated_mlp
from extkv.kernels.gated_mlp import RegisterPlan, gated_mlp_one_row, plan_for
from extkv.kernels.gemv import num_sms
from extkv.kernels.grid_barrier import barrier_counter, grid_barrier
from extkv.kernels.register_slices import two_powers
from extkv.models import load_model, ops
from helpers import (
    assert_replays_like_eager,
    extkv_logits,
    interpreter_rounds_bf16_to_nearest,
    run_interpreted,
    vary_norms,
)

# (attention width, hidden, intermediate): Qwen3-0.6B's and SmolLM2-135M's, and scaled
# down for the interpreter: rows and K in one piece or two (128 programs of 1 and 2 + 1
# rows; 32 programs of 2 + 1 and 4 + 1 rows, K 64 + 32 and 128 + 32).
GPU_SHAPES = ((2048, 1024, 3072), (576, 576, 1536))
SMALL_SHAPES = ((256, 128, 384), (64, 96, 160))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# (dtype, residual dtype or None) of the interpreter's checks: a wider residual stream too
DTYPES = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, None),
)


def operands(width: int, hidden: int, inner: int, dtype: torch.dtype, device: str) -> dict:
    """One attention output row and an MLP's weights giving unit-size outputs."""
    scaled = lambda *size: (torch.randn(*size, device=device) * size[-1] ** -0.5).to(dtype)  # noqa: E731
    return {
        "attn": torch.randn(1, width, device=device).to(dtype),
        "x": (torch.randn(1, hidden, device=device) * 3).to(dtype),
        "norm_weight": (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype),
        "gate_up": scaled(2 * inner, hidden),
        "down": scaled(hidden, inner),
        "out_weight": scaled(hidden, width),
    }


def reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    out_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stream) in fp64, rounded to x's dtype where the GEMVs' outputs and the norm and
    activation kernels round."""
    dtype = x.dtype
    rounded = lambda t: t.to(dtype).double()  # noqa: E731
    if out_weight is not None:
        x = rounded(x.double() @ out_weight.double().T).to(dtype)
    stream = x
    if residual is not None:
        stream = (residual.double() + x.double()).to(residual.dtype)
    gate, up = rounded(rms_normed(stream, norm_weight, 1e-6) @ gate_up.double().T).chunk(2, -1)
    act = rounded(rounded(gate * torch.sigmoid(gate)) * up)
    return (act @ down.double().T).to(dtype), stream


def rms_normed(stream: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp64, rounded to the weight's dtype where the norm kernel rounds."""
    rounded = lambda t: t.to(weight.dtype).double()  # noqa: E731
    s = rounded(stream.double())
    return rounded(weight.double() * rounded(s * torch.rsqrt(s.pow(2).mean(-1, True) + eps)))


def check_one_row(
    width: int,
    hidden: int,
    inner: int,
    dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    projected: bool,
    device: str,
) -> None:
    """Output and stream within the dtype's tolerance of the reference, the stream exactly
    where no projection precedes it, the inputs left as they were."""
    ops_ = operands(width, hidden, inner, dtype, device)
    x = ops_["attn"] if projected else ops_["x"]
    out_weight = ops_["out_weight"] if projected else None
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(1, hidden, device=device).to(residual_dtype)
    args = (x, residual, ops_["norm_weight"], 1e-6, ops_["gate_up"], ops_["down"], out_weight)
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    y, stream = gated_mlp_one_row(*args)
    expected, expected_stream = reference(*before[:3], *before[4:])
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), expected.double(), rtol=tolerance, atol=tolerance)
    if projected:
        torch.testing.assert_close(
            stream.double(), expected_stream.double(), rtol=tolerance, atol=tolerance
        )
    else:
        assert torch.equal(stream, expected_stream)
    assert stream.dtype == (dtype if residual is None else residual_dtype)
    tensors = [(a, b) for a, b in zip(args, before, strict=True) if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in tensors)


def test_two_powers() -> None:
    """A count as two powers of two (the second may be 0), or None."""
    assert two_powers(3072) == (2048, 1024)
    assert two_powers(1024) == (1024, 0)
    assert two_powers(576) == (512, 64)
    assert two_powers(1) == (1, 0)
    assert two_powers(7) is None and two_powers(0) is None


def test_register_plan() -> None:
    """The most programs (<= the SMs) that split the rows evenly in two powers of two, and
    none where a slice would not fit in registers or a K cannot be tiled."""
    qwen = RegisterPlan.of(1024, 3072, 2048, 2, 132)
    assert qwen == RegisterPlan(128, (8, 0), (16, 8), (2048, 0), (1024, 0), (2048, 1024))
    smollm = RegisterPlan.of(576, 1536, 576, 2, 132)
    assert smollm is not None and smollm.programs == 96
    assert smollm.hidden_rows == (4, 2) and smollm.inner_rows == (16, 0)
    assert RegisterPlan.of(2048, 6144, 2048, 2, 132) is None  # Qwen3-1.7B: too large
    assert RegisterPlan.of(1024, 3000, 2048, 2, 132) is None  # 3000 is no two powers
    assert RegisterPlan.of(1024, 3072, 2048, 4, 132) is None  # fp32: twice the bytes
    assert RegisterPlan.of(1024, 3072, 4096, 2, 132) is None  # o_proj's slice too large
    assert RegisterPlan.of(1024, 3072, 0, 2, 132).attn_k == (0, 0)  # no o_proj: it fits


def test_bad_inputs_are_refused() -> None:
    """Each refusal names the operand and the shape it must have; nothing is launched."""
    o = operands(64, 96, 160, torch.float32, "cpu")
    x, nw, gu, down, ow = o["x"], o["norm_weight"], o["gate_up"], o["down"], o["out_weight"]
    cases = [
        ((x, None, nw, 1e-6, gu[1:], down), "gate_up must be (320, 96)"),
        ((x, None, nw, 1e-6, gu[0], down), "gate_up must be (2I, H) and down (H, I)"),
        ((x, None, nw, 1e-6, gu, down.half()), "the weights' dtype must be x's"),
        ((x, None, nw[1:], 1e-6, gu, down), "norm_weight must be (96,)"),
        ((x, x[:, 1:], nw, 1e-6, gu, down), "residual must be (1, 96)"),
        ((x.repeat(2, 1), None, nw, 1e-6, gu, down), "x must be one row (1, 96)"),
        ((x[:, :64], None, nw, 1e-6, gu, down, ow.t()), "out_weight must be (96, K)"),
        ((x, None, nw, 1e-6, gu, down, ow), "x must be one row (1, 64)"),
        ((x.t().contiguous().t(), None, nw, 1e-6, gu, down.t().contiguous().t()), "contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            gated_mlp_one_row(*args)
    big = operands(64, 100, 160, torch.float32, "cpu")  # 100 is no two powers: no plan
    with pytest.raises(ValueError, match="hidden 100 and inner 160 does not fit in registers"):
        gated_mlp_one_row(big["x"], None, big["norm_weight"], 1e-6, big["gate_up"], big["down"])


def test_cpu_gated_mlp_is_the_separate_ops() -> None:
    """Off CUDA ops.gated_mlp is rms_norm_linear then silu_and_mul_linear (after `linear`
    by the output projection, where one is given)."""
    o = operands(32, 64, 96, torch.float32, "cpu")
    x = o["x"].repeat(3, 1)
    mlp = ops.GatedMLPWeights(o["norm_weight"], 1e-6, o["gate_up"], o["down"])
    out_weight = torch.randn(64, 32)
    residual = torch.randn(3, 64)
    for inputs, projected in ((x, x), (x[:, :32], ops.linear(x[:, :32], out_weight))):
        weight = None if inputs is x else out_weight
        y, stream = ops.gated_mlp(inputs, residual.clone(), mlp, weight)
        hidden, expected_stream = ops.rms_norm_linear(
            projected, residual.clone(), o["norm_weight"], 1e-6, o["gate_up"]
        )
        assert torch.equal(y, ops.silu_and_mul_linear(hidden, o["down"]))
        assert torch.equal(stream, expected_stream)


def test_persistent_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """EXTKV_PERSISTENT takes 0 or 1 (default 1); anything else (2, which ran the next
    layer's qkv too, included) is refused by name."""
    monkeypatch.delenv("EXTKV_PERSISTENT", raising=False)
    assert ops.persistent_decode()
    monkeypatch.setenv("EXTKV_PERSISTENT", "0")
    assert not ops.persistent_decode()
    for wrong in ("2", "yes"):
        monkeypatch.setenv("EXTKV_PERSISTENT", wrong)
        with pytest.raises(ValueError, match=rf"EXTKV_PERSISTENT must be 0 .* or 1 .*'{wrong}'"):
            ops.persistent_decode()


def test_barrier_counter_is_made_once_per_grid() -> None:
    """One counter per (owner, device, programs), zero when made and the same tensor after."""
    cpu = torch.device("cpu")
    counter = barrier_counter("test", cpu, 3)
    assert counter.dtype == torch.int64 and counter.item() == 0
    assert barrier_counter("test", cpu, 3) is counter
    assert barrier_counter("test", cpu, 4) is not counter


# ---------------------------------------------------------------- CPU: Triton interpreter


def check_kernel_through_the_model() -> None:
    """A 3-layer model's logits for one row are the same (fp32, to rounding) whichever
    EXTKV_PERSISTENT runs them, each layer's MLP in the kernel at 1, none at 0. CPU rows
    are let into the decode GEMV's path, which the interpreter runs, by `takes_gemv`."""
    gemv_rows = ops.takes_gemv

    def also_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
        one_row = x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
        return gemv_rows(x, weight) or (one_row and x.dtype == weight.dtype == torch.float32)

    ops.takes_gemv = also_cpu
    calls = []
    kernel = gated_mlp.gated_mlp_one_row

    def spy(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(args[-1] is not None)  # was it given the output projection
        return kernel(*args)

    gated_mlp.gated_mlp_one_row = spy
    with tempfile.TemporaryDirectory() as folder:
        path = make_random_checkpoint(folder, "qwen3", with_tokenizer=False, num_hidden_layers=3)
        model = load_model(path, torch.float32, torch.device("cpu"))[0]
    vary_norms(model)
    token = [torch.tensor([5])]
    logits = {}
    try:
        for level in ("0", "1"):
            os.environ["EXTKV_PERSISTENT"] = level
            calls.clear()
            logits[level] = extkv_logits(model, token)
            assert calls == {"0": [], "1": [True] * 3}[level], calls
    finally:
        ops.takes_gemv, gated_mlp.gated_mlp_one_row = gemv_rows, kernel
        del os.environ["EXTKV_PERSISTENT"]
    torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-4, atol=1e-4)


def interpreter_checks() -> list[Callable[[], None]]:
    return [
        check_kernel_through_the_model,
        *(
            partial(check_one_row, *shape, dtype, residual_dtype, projected, "cpu")
            for shape in SMALL_SHAPES
            for dtype, residual_dtype in DTYPES
            for projected in (False, True)
        ),
    ]


def test_interpreted() -> None:
    run_interpreted(__file__)


# ---------------------------------------------------------------- GPU


@triton.jit
def _barrier_rounds_kernel(slots_ptr, sums_ptr, counter_ptr, ROUNDS: tl.constexpr):
    """Each round every program writes round * (its id + 1) to its slot, waits, sums all
    slots into its own entry of `sums`, and waits again before the next round's write."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for r in range(ROUNDS):
        tl.store(slots_ptr + pid, r * (pid + 1))
        grid_barrier(counter_ptr, programs)
        total = tl.load(slots_ptr) * 0
        for p in range(programs):
            total += tl.load(slots_ptr + p)
        tl.store(sums_ptr + r * programs + pid, total)
        grid_barrier(counter_ptr, programs)


@pytest.mark.gpu
def test_grid_barrier_orders_every_program() -> None:
    """Over 64 rounds and three launches on every SM, each program sees every other's
    write of the round: no program passes the barrier early, and the counter needs no
    reset (it ends each launch at a multiple of the programs)."""
    programs, rounds = num_sms(torch.device("cuda")), 64
    counter = barrier_counter("test", torch.device("cuda"), programs)
    expected = torch.arange(rounds, device="cuda", dtype=torch.int32)[:, None]
    expected = expected * (programs * (programs + 1) // 2)
    for launch in range(1, 4):
        slots = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
        sums = torch.zeros(rounds, programs, dtype=torch.int32, device="cuda")
        _barrier_rounds_kernel[(programs,)](slots, sums, counter, ROUNDS=rounds)
        assert torch.equal(sums, expected.expand(rounds, programs))
        assert counter.item() == launch * 2 * rounds * programs


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gated_mlp_one_row_gpu(shape: tuple[int, int, int]) -> None:
    for residual_dtype in (torch.bfloat16, torch.float32, None):
        for projected in (False, True):
            check_one_row(*shape, torch.bfloat16, residual_dtype, projected, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_ops_take_the_kernel_at_one_row_gpu(
    shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ops.gated_mlp runs the kernel for one row where it has a plan (its bits) at
    EXTKV_PERSISTENT=1, and the GEMVs at 0 (their bits)."""
    o = operands(*shape, torch.bfloat16, "cuda")
    assert plan_for(o["attn"], o["gate_up"], o["down"], o["out_weight"]) is not None
    mlp = ops.GatedMLPWeights(o["norm_weight"], 1e-6, o["gate_up"], o["down"])
    residual = torch.randn_like(o["x"])
    args = (o["attn"], residual, o["norm_weight"], 1e-6, o["gate_up"], o["down"], o["out_weight"])
    results = {}
    for level in ("0", "1"):
        monkeypatch.setenv("EXTKV_PERSISTENT", level)
        results[level] = ops.gated_mlp(o["attn"], residual, mlp, o["out_weight"])
    assert all(map(torch.equal, results["1"], gated_mlp_one_row(*args)))
    projected = ops.linear(o["attn"], o["out_weight"])
    gate_up, stream = ops.rms_norm_linear(projected, residual, mlp.norm, mlp.eps, mlp.gate_up)
    assert torch.equal(results["0"][0], ops.silu_and_mul_linear(gate_up, mlp.down))
    assert torch.equal(results["0"][1], stream)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_cuda_graph_replay_gpu(shape: tuple[int, int, int]) -> None:
    """Captured once, replayed over new inputs: the eager kernel's bits every time."""
    o = operands(*shape, torch.bfloat16, "cuda")
    weights = (o["norm_weight"], 1e-6, o["gate_up"], o["down"], o["out_weight"])
    inputs = [o["attn"].clone(), torch.randn_like(o["x"])]  # the attention row, the residual
    assert_replays_like_eager(
        lambda attn, residual: gated_mlp_one_row(attn, residual, *weights), inputs
    )


if __name__ == "__main__":
    interpreter_rounds_bf16_to_nearest()
    for check in interpreter_checks():
        torch.manual_seed(0)
        check()
