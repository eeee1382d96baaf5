"""The small-batch GEMV (extkv.kernels.gemv) against F.linear in fp32, its batch
invariance, CUDA-graph replay, and the `ops.linear` dispatch.

As in test_fused_kernels, the CPU checks run this file as a script under the
Triton interpreter (`TRITON_INTERPRET=1`, in a subprocess); the GPU tests run
the compiled kernel on Qwen3-0.6B's decode shapes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from extkv.kernels import arrivals, pdl
from extkv.kernels.activation import silu_and_mul
from extkv.kernels.gemv import (
    MAX_ROWS,
    GemvConfig,
    gemv_config,
    linear_small_batch,
    rms_norm_linear_small_batch,
    silu_and_mul_linear_small_batch,
)
from extkv.kernels.norm import rms_norm
from extkv.kernels.pdl import pdl_launch
from extkv.models import ops
from helpers import (
    interpreter_dots_bf16_as_numbers,
    interpreter_rounds_bf16_to_nearest,
    run_interpreted,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Against the fp32 sum: the output's one rounding (half an ulp) plus the sum's order.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-8, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-5),
}
# Qwen3-0.6B's (K, N): qkv, o_proj, gate_up, down; and scaled down 8x for the interpreter.
QWEN3_SHAPES = ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024))
SMALL_SHAPES = (
    *((k // 8, n // 8) for k, n in QWEN3_SHAPES),
    (100, 77),  # neither a multiple of any block
    (1100, 40),  # several K chunks, the last one partial
)


def random_linear(
    num_rows: int, k: int, n: int, dtype: torch.dtype, with_bias: bool, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x as rows of a wider tensor (a row stride other than K); outputs of about unit size."""
    x = torch.randn(num_rows, k + 5, dtype=dtype, device=device)[:, :k]
    weight = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
    bias = torch.randn(n, dtype=dtype, device=device) if with_bias else None
    return x, weight, bias


def assert_matches_fp32(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """out is F.linear of the same values in fp32, rounded once to x's dtype."""
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, **TOLERANCES[x.dtype])


# Tilings that split K (2 or 3 slices; a last slice shorter or empty), forced where
# the interpreter's shapes would not split on their own.
SPLITS = (GemvConfig(16, 32, split_k=2), GemvConfig(32, 64, split_k=3, num_stages=2))


def check_linear(
    num_rows: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    with_bias: bool,
    device: str,
    config: GemvConfig | None = None,
) -> None:
    x, weight, bias = random_linear(num_rows, k, n, dtype, with_bias, device)
    assert_matches_fp32(linear_small_batch(x, weight, bias, config), x, weight, bias)
    if config is not None and config.split_k > 1:  # the last of each tile reset its counter
        assert not arrivals._COUNTERS[("linear_small_batch", x.device)].any()


def check_batch_invariant(
    k: int, n: int, dtype: torch.dtype, device: str, config: GemvConfig | None = None
) -> None:
    """Each row's output is bit-identical whatever the number of rows around it."""
    x, weight, bias = random_linear(MAX_ROWS, k, n, dtype, True, device)
    full = linear_small_batch(x, weight, bias, config)
    for num_rows in (1, 2, 3, 8, MAX_ROWS):
        rows = linear_small_batch(x[:num_rows], weight, bias, config)
        assert torch.equal(rows, full[:num_rows])
    assert torch.equal(linear_small_batch(x[5:6], weight, bias, config), full[5:6])


def check_gated(
    num_rows: int, k: int, n: int, dtype: torch.dtype, device: str, config: GemvConfig | None = None
) -> None:
    """silu(gate) * up fused into the GEMV's input: the bits of the activation kernel
    then the GEMV, for each row whatever the rows around it."""
    gate_up = torch.randn(MAX_ROWS, 2 * k + 3, dtype=dtype, device=device)[:, : 2 * k]
    weight = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
    bias = torch.randn(n, dtype=dtype, device=device)
    fused = silu_and_mul_linear_small_batch(gate_up[:num_rows], weight, bias, config)
    two_kernels = linear_small_batch(silu_and_mul(gate_up[:num_rows]), weight, bias, config)
    assert torch.equal(fused, two_kernels)
    everything = silu_and_mul_linear_small_batch(gate_up, weight, bias, config)
    assert torch.equal(fused, everything[:num_rows])


def check_normed(
    num_rows: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    device: str,
    config: GemvConfig | None = None,
) -> None:
    """RMSNorm(x + residual) fused into the GEMV's input: the new residual stream is the
    norm kernel's bit for bit (the residual given is left as it was), y the GEMV of the
    norm kernel's output up to the sum of squares' order, and batch-invariant."""
    x = torch.randn(MAX_ROWS, k + 5, dtype=dtype, device=device)[:, :k] * 3
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(MAX_ROWS, k, dtype=residual_dtype, device=device)
    norm_weight = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    weight = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
    rows = residual if residual is None else residual[:num_rows]
    before = None if rows is None else rows.clone()
    y, stream = rms_norm_linear_small_batch(
        x[:num_rows], rows, norm_weight, 1e-6, weight, None, config
    )
    if rows is None:
        assert stream is x[:num_rows] or torch.equal(stream, x[:num_rows])
        normed = rms_norm(x[:num_rows], norm_weight, 1e-6)
    else:
        assert torch.equal(rows, before)
        normed, expected_stream = rms_norm(x[:num_rows], norm_weight, 1e-6, before.clone())
        assert stream.dtype == residual_dtype and torch.equal(stream, expected_stream)
    torch.testing.assert_close(
        y.float(), linear_small_batch(normed, weight, None, config).float(), **TOLERANCES[dtype]
    )
    everything, _ = rms_norm_linear_small_batch(
        x, residual, norm_weight, 1e-6, weight, None, config
    )
    assert torch.equal(y, everything[:num_rows])


def test_pdl_is_for_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA (the interpreter's CPU tensors) kernels launch serially, with no PDL option,
    whatever EXTKV_PDL says; a value other than 0 or 1 is refused."""
    for wanted in ("0", "1"):
        monkeypatch.setenv("EXTKV_PDL", wanted)
        pdl._pdl_supported.cache_clear()
        assert pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv("EXTKV_PDL", "yes")
    pdl._pdl_supported.cache_clear()
    with pytest.raises(ValueError, match="EXTKV_PDL must be 0 \\(serial launches\\) or 1"):
        pdl_launch(torch.device("cpu"))
    pdl._pdl_supported.cache_clear()


def test_narrow_weights_split_k_to_fill_the_device() -> None:
    """Qwen3-0.6B's N=1024 weights have 16 tiles of 64 rows for 132 SMs: K is split (in
    slices of at least 3 stages, one program per SM at most); wide weights are not."""
    for k, n in QWEN3_SHAPES:
        config = gemv_config(n, k, 2, 132)
        assert k >= config.split_k * 3 * config.block_k
        assert -(-n // config.block_n) * config.split_k <= 132
    assert gemv_config(1024, 2048, 2, 132).split_k == 4  # o_proj: slices of 512
    assert gemv_config(1024, 3072, 2, 132).split_k == 8  # down: slices of 384
    assert gemv_config(6144, 1024, 2, 132).split_k == 1  # gate_up: 96 tiles
    assert gemv_config(1024, 512, 2, 132).split_k == 1  # 4 stages of K: nothing to split
    assert gemv_config(1024, 2048, 2, 32).split_k == 1  # 16 tiles fill 32 SMs well enough


def test_bad_inputs_are_refused() -> None:
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="x \\(M, K\\) and weight \\(N, K\\)"):
        linear_small_batch(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        linear_small_batch(torch.randn(17, 8), weight)
    with pytest.raises(ValueError, match="stride\\(1\\) == 1"):
        linear_small_batch(x, torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="weight's dtype"):
        linear_small_batch(x, weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias must be a contiguous \\(4,\\)"):
        linear_small_batch(x, weight, torch.randn(5))
    with pytest.raises(ValueError, match="gate_up must be \\(M, 2K\\), got \\(2, 7\\)"):
        silu_and_mul_linear_small_batch(torch.randn(2, 7), weight)
    with pytest.raises(ValueError, match="x \\(M, K\\) and weight \\(N, K\\)"):
        silu_and_mul_linear_small_batch(torch.randn(2, 8), weight)  # K = 4, not 8
    norm_weight = torch.ones(8)
    with pytest.raises(ValueError, match="residual must be x's shape \\(2, 8\\)"):
        rms_norm_linear_small_batch(x, torch.randn(3, 8), norm_weight, 1e-6, weight)
    with pytest.raises(ValueError, match="norm_weight must be a contiguous \\(8,\\), got \\(4,\\)"):
        rms_norm_linear_small_batch(x, None, torch.ones(4), 1e-6, weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_linear_is_f_linear(dtype: torch.dtype) -> None:
    """Off CUDA, ops.linear is F.linear bit for bit (the models match transformers)."""
    x, weight, bias = random_linear(1, 64, 32, dtype, True, "cpu")
    assert torch.equal(ops.linear(x, weight, bias), F.linear(x, weight, bias))


# ---------------------------------------------------------------- CPU: Triton interpreter


def interpreter_checks() -> list[Callable[[], None]]:
    return [
        *(
            partial(check_linear, num_rows, k, n, dtype, with_bias, "cpu")
            for k, n in SMALL_SHAPES
            for num_rows in (1, 2, 3, 8)
            for dtype in DTYPES
            for with_bias in (False, True)
        ),
        *(partial(check_batch_invariant, 100, 77, dtype, "cpu") for dtype in DTYPES),
        *(
            partial(check_linear, num_rows, k, n, dtype, True, "cpu", config)
            for k, n in ((100, 77), (1100, 40), (128, 512))
            for num_rows in (1, 3)
            for dtype in (torch.float32, torch.bfloat16)
            for config in SPLITS
        ),
        *(partial(check_batch_invariant, 1100, 40, torch.bfloat16, "cpu", c) for c in SPLITS),
        *(
            partial(check_gated, num_rows, k, n, dtype, "cpu", config)
            for k, n in ((384, 128), (100, 77))
            for num_rows in (1, 3)
            for dtype in (torch.float32, torch.bfloat16)
            for config in (None, *SPLITS)
        ),
        *(
            partial(check_normed, num_rows, k, n, dtype, residual_dtype, "cpu", config)
            for k, n in ((128, 512), (100, 77))
            for num_rows in (1, 3)
            for dtype, residual_dtype in (
                (torch.float32, torch.float32),
                (torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, torch.float32),
                (torch.bfloat16, None),
            )
            for config in (None, SPLITS[1])
        ),
    ]


def test_interpreted() -> None:
    run_interpreted(__file__)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize(("k", "n"), QWEN3_SHAPES)
def test_cuda_graph_replay_matches_f_linear(
    k: int, n: int, num_rows: int, dtype: torch.dtype, with_bias: bool
) -> None:
    """Captured once, replayed over new x: F.linear's values, and the eager kernel's bits."""
    static, weight, bias = random_linear(num_rows, k, n, dtype, with_bias, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear_small_batch(static, weight, bias)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_small_batch(static, weight, bias)
    for _ in range(2):
        x = torch.randn_like(static)
        static.copy_(x)
        graph.replay()
        assert_matches_fp32(out, x, weight, bias)
        assert torch.equal(out, linear_small_batch(x, weight, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), QWEN3_SHAPES)
def test_batch_invariant_gpu(k: int, n: int, dtype: torch.dtype) -> None:
    check_batch_invariant(k, n, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 4, 16])
@pytest.mark.parametrize(("k", "n"), QWEN3_SHAPES)
def test_fused_inputs_gpu(k: int, n: int, num_rows: int) -> None:
    """The activation and the norm fused into the compiled GEMV."""
    check_gated(num_rows, k, n, torch.bfloat16, "cuda")
    for residual_dtype in (torch.bfloat16, torch.float32, None):
        check_normed(num_rows, k, n, torch.bfloat16, residual_dtype, "cuda")


@pytest.mark.gpu
def test_pdl_on_hopper() -> None:
    """sm90+ launches the step's kernels with PDL unless EXTKV_PDL=0 (gpu-check
    step-serial runs the engine's GPU tests that way)."""
    hopper = torch.cuda.get_device_capability()[0] >= 9
    wanted = hopper and os.environ.get("EXTKV_PDL", "1") == "1"
    assert pdl_launch(torch.device("cuda")).get("launch_pdl", False) == wanted


@pytest.mark.gpu
def test_dispatch_gpu() -> None:
    """ops.linear takes the GEMV for up to GEMV_MAX_ROWS low-precision rows, cuBLAS
    beyond and for fp32 (each bit for bit); no assertion on speed (bench_step measures)."""
    x, weight, bias = random_linear(ops.GEMV_MAX_ROWS + 1, 1024, 1024, torch.bfloat16, True, "cuda")
    for num_rows in (1, ops.GEMV_MAX_ROWS):
        rows = x[:num_rows]
        assert torch.equal(ops.linear(rows, weight, bias), linear_small_batch(rows, weight, bias))
    assert torch.equal(ops.linear(x, weight, bias), F.linear(x, weight, bias))
    x, weight, bias = x.float(), weight.float(), bias.float()
    assert torch.equal(ops.linear(x[:1], weight, bias), F.linear(x[:1], weight, bias))


if __name__ == "__main__":
    interpreter_rounds_bf16_to_nearest()
    interpreter_dots_bf16_as_numbers()
    for check in interpreter_checks():
        torch.manual_seed(0)
        check()
