"""The decode step's gated MLP in one persistent kernel (extkv.kernels.gated_mlp) against
the two fused GEMVs it replaces, bit for bit, and the grid barrier it stands on.

As in test_gemv, the CPU checks run this file as a script under the Triton interpreter
(`TRITON_INTERPRET=1`, in a subprocess), where the kernel launches once per stage; the
GPU tests run its one launch, barrier included, eagerly and replayed in a CUDA graph.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from extkv.demo import make_random_checkpoint
from extkv.kernels import pdl
from extkv.kernels.gated_mlp import gated_mlp_small_batch
from extkv.kernels.gemv import (
    MAX_ROWS,
    linear_small_batch,
    num_sms,
    rms_norm_linear_small_batch,
    silu_and_mul_linear_small_batch,
)
from extkv.kernels.grid_barrier import barrier_counter, grid_barrier
from extkv.models import load_model, ops
from helpers import (
    interpreter_dots_bf16_as_numbers,
    interpreter_rounds_bf16_to_nearest,
    run_interpreted,
)

# (hidden, intermediate): Qwen3-0.6B's and SmolLM2-135M's, and scaled down for the
# interpreter: the down projection splits K (128, 384) or not, blocks left partial (96, 160).
GPU_SHAPES = ((1024, 3072), (576, 1536))
SMALL_SHAPES = ((128, 384), (96, 160))


def mlp_operands(
    num_rows: int, hidden: int, inner: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, ...]:
    """x as rows of a wider tensor; norm, gate_up and down weights giving unit-size outputs."""
    x = torch.randn(MAX_ROWS, hidden + 3, dtype=dtype, device=device)[:num_rows, :hidden] * 3
    norm_weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    gate_up = (torch.randn(2 * inner, hidden, device=device) * hidden**-0.5).to(dtype)
    down = (torch.randn(hidden, inner, device=device) * inner**-0.5).to(dtype)
    return x, norm_weight, gate_up, down


def two_kernels(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the persistent kernel replaces: the norm-fused gate_up GEMV, the SiLU-fused
    down GEMV."""
    hidden, stream = rms_norm_linear_small_batch(x, residual, norm_weight, 1e-6, gate_up)
    return silu_and_mul_linear_small_batch(hidden, down), stream


def check_gated_mlp(
    num_rows: int,
    hidden: int,
    inner: int,
    dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    device: str,
) -> None:
    """The two kernels' output and residual stream bit for bit, the residual given left as
    it was, and each row's output whatever rows come with it."""
    x, norm_weight, gate_up, down = mlp_operands(num_rows, hidden, inner, dtype, device)
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(num_rows, hidden, dtype=residual_dtype, device=device)
    before = None if residual is None else residual.clone()
    y, stream = gated_mlp_small_batch(x, residual, norm_weight, 1e-6, gate_up, down)
    expected, expected_stream = two_kernels(x, before, norm_weight, gate_up, down)
    assert y.dtype == x.dtype and torch.equal(y, expected)
    assert torch.equal(stream, expected_stream)
    if residual is None:
        assert stream is x
    else:
        assert stream.dtype == residual_dtype and torch.equal(residual, before)
    wider = torch.cat([x, torch.randn(MAX_ROWS - num_rows, hidden, dtype=dtype, device=device)])
    everything, _ = gated_mlp_small_batch(wider, None, norm_weight, 1e-6, gate_up, down)
    alone, _ = gated_mlp_small_batch(x, None, norm_weight, 1e-6, gate_up, down)
    assert torch.equal(everything[:num_rows], alone)


def check_out_proj_gated_mlp(
    num_rows: int, width: int, hidden: int, inner: int, dtype: torch.dtype, device: str
) -> None:
    """With the attention's output projection in front: the three GEMVs' bits, the
    residual stream summed with the projection's output."""
    _, norm_weight, gate_up, down = mlp_operands(num_rows, hidden, inner, dtype, device)
    attn = torch.randn(MAX_ROWS, width + 3, dtype=dtype, device=device)[:num_rows, :width]
    out_weight = (torch.randn(hidden, width, device=device) * width**-0.5).to(dtype)
    residual = torch.randn(num_rows, hidden, dtype=dtype, device=device)
    before = residual.clone()
    y, stream = gated_mlp_small_batch(attn, residual, norm_weight, 1e-6, gate_up, down, out_weight)
    x = linear_small_batch(attn, out_weight)
    expected, expected_stream = two_kernels(x, before, norm_weight, gate_up, down)
    assert torch.equal(y, expected) and torch.equal(stream, expected_stream)
    assert torch.equal(residual, before)


def test_bad_inputs_are_refused() -> None:
    """Each refusal names the operand and the shape it must have; nothing is launched."""
    x, norm_weight, gate_up, down = mlp_operands(2, 64, 96, torch.float32, "cpu")
    cases = [
        ((x, None, norm_weight, 1e-6, gate_up[1:], down), "gate_up_weight must be (2I, 64)"),
        ((x, None, norm_weight, 1e-6, gate_up[:, 1:], down), "and weight (N, K), got (2, 64)"),
        ((x, None, norm_weight, 1e-6, gate_up, down.t()), "down_weight must be (64, 96)"),
        ((x, None, norm_weight, 1e-6, gate_up, down.half()), "down_weight's dtype"),
        ((x, None, norm_weight[1:], 1e-6, gate_up, down), "norm_weight must be"),
        ((x, x[:1], norm_weight, 1e-6, gate_up, down), "residual must be x's shape"),
        ((x.repeat(9, 1), None, norm_weight, 1e-6, gate_up, down), f"at most {MAX_ROWS} rows"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            gated_mlp_small_batch(*args)
    for stages in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_stages must be a positive int or None"):
            gated_mlp_small_batch(x, None, norm_weight, 1e-6, gate_up, down, num_stages=stages)
    attn, out_weight = torch.randn(2, 32), torch.randn(64, 32)
    with pytest.raises(ValueError, match="weight \\(N, K\\)"):
        gated_mlp_small_batch(attn, None, norm_weight, 1e-6, gate_up, down, out_weight.t())
    with pytest.raises(ValueError, match=re.escape("norm_weight must be a contiguous (64,)")):
        gated_mlp_small_batch(attn, None, norm_weight[1:], 1e-6, gate_up, down, out_weight)


def test_cpu_gated_mlp_is_the_separate_ops() -> None:
    """Off the GEMV (the CPU, here) ops.gated_mlp is rms_norm_linear then
    silu_and_mul_linear (after `linear` by the output projection, where one is given),
    the residual updated in place as the norm does."""
    x, norm_weight, gate_up, down = mlp_operands(3, 64, 96, torch.float32, "cpu")
    mlp = ops.GatedMLPWeights(norm_weight, 1e-6, gate_up, down)
    out_weight = torch.randn(64, 32)
    residual = torch.randn(3, 64)
    for inputs, projected in ((x, x), (x[:, :32], ops.linear(x[:, :32], out_weight))):
        weight = None if inputs is x else out_weight
        y, stream = ops.gated_mlp(inputs, residual.clone(), mlp, weight)
        hidden, expected_stream = ops.rms_norm_linear(
            projected, residual.clone(), norm_weight, 1e-6, gate_up
        )
        assert torch.equal(y, ops.silu_and_mul_linear(hidden, down))
        assert torch.equal(stream, expected_stream)


def test_persistent_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """EXTKV_PERSISTENT takes 0 or 1 (default 0); anything else is refused by name."""
    monkeypatch.delenv("EXTKV_PERSISTENT", raising=False)
    assert not ops.persistent_decode()
    monkeypatch.setenv("EXTKV_PERSISTENT", "1")
    assert ops.persistent_decode()
    monkeypatch.setenv("EXTKV_PERSISTENT", "yes")
    with pytest.raises(ValueError, match=r"EXTKV_PERSISTENT must be 0 .* or 1 .*, got 'yes'"):
        ops.persistent_decode()


def test_next_weights_fit_half_of_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A persistent kernel asks L2 for the leading next weights that fit in half of it
    together, none after the first that does not; off CUDA (no L2 known) for none."""
    weights = tuple(torch.empty(n, dtype=torch.uint8) for n in (20, 20, 20))
    addresses = [w.data_ptr() for w in weights]
    assert pdl.next_weights(weights) == ([0] * 6, 0)
    monkeypatch.setattr(pdl, "_l2_bytes", lambda device: 100)
    assert pdl.next_weights(weights) == ([addresses[0], 20, addresses[1], 20, 0, 0], 2)
    big = torch.empty(60, dtype=torch.uint8)
    assert pdl.next_weights((big, *weights[:2]))[1] == 0
    with pytest.raises(ValueError, match="at most 3 next weights, got 4"):
        pdl.next_weights((*weights, big))


def test_each_layer_prefetches_the_next_layers_qkv(tmp_path: Path) -> None:
    """A decoder layer whose output projection runs in its MLP's kernel asks L2, from that
    kernel, for the next layer's qkv weight (the one that layer reads first); the last
    layer for nothing."""
    folder = make_random_checkpoint(tmp_path, "qwen3", with_tokenizer=False, num_hidden_layers=3)
    layers = load_model(folder, torch.float32, torch.device("cpu"))[0].model.layers
    assert all(layer.fuses_out_proj() for layer in layers)
    for layer, following in itertools.pairwise(layers):
        assert layer.prefetch_next == (following.self_attn.qkv_proj.weight,)
    assert layers[-1].prefetch_next == ()


# ---------------------------------------------------------------- CPU: Triton interpreter


def interpreter_checks() -> list[Callable[[], None]]:
    return [
        *(
            partial(check_gated_mlp, num_rows, hidden, inner, dtype, residual_dtype, "cpu")
            for hidden, inner in SMALL_SHAPES
            for num_rows in (1, 3)
            for dtype, residual_dtype in (
                (torch.float32, torch.float32),
                (torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, torch.float32),
                (torch.float16, None),
            )
        ),
        *(
            partial(check_out_proj_gated_mlp, num_rows, 2 * hidden, hidden, inner, dtype, "cpu")
            for hidden, inner in SMALL_SHAPES
            for num_rows in (1, 3)
            for dtype in (torch.float32, torch.bfloat16)
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


def test_barrier_counter_is_made_once_per_grid() -> None:
    """One counter per (owner, device, programs), zero when made and the same tensor after."""
    cpu = torch.device("cpu")
    counter = barrier_counter("test", cpu, 3)
    assert counter.dtype == torch.int64 and counter.item() == 0
    assert barrier_counter("test", cpu, 3) is counter
    assert barrier_counter("test", cpu, 4) is not counter


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 4, 16])
@pytest.mark.parametrize(("hidden", "inner"), GPU_SHAPES)
def test_gated_mlp_gpu(hidden: int, inner: int, num_rows: int) -> None:
    for residual_dtype in (torch.bfloat16, torch.float32, None):
        check_gated_mlp(num_rows, hidden, inner, torch.bfloat16, residual_dtype, "cuda")
    check_out_proj_gated_mlp(num_rows, 2 * hidden, hidden, inner, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_depth_keeps_the_bits_gpu(stages: int) -> None:
    """`stages` changes how deep the GEMV loops pipeline, not what they add up."""
    x, norm_weight, gate_up, down = mlp_operands(4, 1024, 3072, torch.bfloat16, "cuda")
    attn = torch.randn(4, 2048, dtype=torch.bfloat16, device="cuda")
    out_weight = (torch.randn(1024, 2048, device="cuda") * 2048**-0.5).to(torch.bfloat16)
    args = (attn, x, norm_weight, 1e-6, gate_up, down, out_weight)
    expected = gated_mlp_small_batch(*args)
    assert all(map(torch.equal, gated_mlp_small_batch(*args, num_stages=stages), expected))


@pytest.mark.gpu
@pytest.mark.parametrize(("hidden", "inner"), GPU_SHAPES)
def test_cuda_graph_replay_gpu(hidden: int, inner: int) -> None:
    """Captured once, replayed over new inputs: the two kernels' bits every time."""
    x, norm_weight, gate_up, down = mlp_operands(1, hidden, inner, torch.bfloat16, "cuda")
    static_x, static_residual = x.clone(), torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, and make the barrier counter, outside the capture
        gated_mlp_small_batch(static_x, static_residual, norm_weight, 1e-6, gate_up, down)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, stream = gated_mlp_small_batch(
            static_x, static_residual, norm_weight, 1e-6, gate_up, down
        )
    for _ in range(3):
        static_x.copy_(torch.randn_like(x))
        static_residual.copy_(torch.randn_like(x))
        graph.replay()
        expected, expected_stream = two_kernels(
            static_x, static_residual, norm_weight, gate_up, down
        )
        assert torch.equal(y, expected) and torch.equal(stream, expected_stream)


if __name__ == "__main__":
    interpreter_rounds_bf16_to_nearest()
    interpreter_dots_bf16_as_numbers()
    for check in interpreter_checks():
        torch.manual_seed(0)
        check()
