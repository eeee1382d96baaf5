"""The Triton chunked SSD scan of a Mamba2 prefill (extkv.kernels.ssd_prefill) against
the torch scan it replaces on CUDA (`ssd_varlen`): under the Triton interpreter on the
CPU, compiled on the GPU.

Triton picks its interpreter when kernels are decorated, so the CPU checks run this file
as a script in a subprocess with `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from extkv.attention.metadata import MambaMetadata
from extkv.kernels.causal_conv import causal_conv_prefill
from extkv.kernels.ssd_prefill import chunk_layout, ssd_prefill
from extkv.models.mamba2 import Mamba2Dims, Mamba2Mixer
from extkv.models.mamba2_ops import causal_conv_varlen, ssd_varlen, time_step
from helpers import (
    backport_interpreter_index_fix,
    interpreter_dots_bf16_as_numbers,
    interpreter_rounds_bf16_to_nearest,
    patch_interpreter_masks,
)


@dataclass(frozen=True)
class Scan:
    """One scan's shape: sequence lengths, heads, groups, head dim, state size, chunk."""

    lens: tuple[int, ...]
    heads: int = 4
    groups: int = 2
    head_dim: int = 16
    state: int = 16
    chunk: int = 16


CPU_SCANS = [
    Scan((5, 40, 1, 17)),  # several chunks, one token, a partial chunk
    Scan((70, 3, 129), heads=4, groups=1, head_dim=24, state=20, chunk=32),  # odd sizes
    Scan((70, 3, 129), heads=2, groups=2, head_dim=80, state=16, chunk=64),  # 2 channel tiles
    Scan((1,), chunk=256),  # one token: a chunk of 1
    Scan((9, 300), chunk=256),  # the longest prompt's chunks: 256-token chunks cut to 256
]
GPU_SCANS = [
    Scan((256,) * 64, heads=32, groups=1, head_dim=64, state=128, chunk=256),  # bench_hybrid b64
    Scan((1000, 3, 700), heads=32, groups=1, head_dim=64, state=128, chunk=256),
    Scan((513, 1, 77), heads=8, groups=2, head_dim=128, state=64, chunk=128),
]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def cu_seqlens(lens: tuple[int, ...]) -> list[int]:
    return [0, *itertools.accumulate(lens)]


def state_rows(num_seqs: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's cache row (shuffled among num_seqs + 3, the last sequence a
    padding row -1 where there are several) and whether it carries a state (alternating)."""
    indices = torch.randperm(num_seqs + 3)[:num_seqs].to(torch.int32)
    if num_seqs > 1:
        indices[-1] = -1
    carry = torch.arange(num_seqs) % 2 == 0
    return indices.to(device), carry.to(device)


def initial_rows(cache: torch.Tensor, indices: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    """What each sequence starts from: its row where it carries one, zeros otherwise."""
    rows = cache[indices.clamp(min=0).long()].float()
    keep = (carry & (indices >= 0)).view(-1, *[1] * (cache.dim() - 1))
    return torch.where(keep, rows, 0.0)


def assert_rows_written(
    cache: torch.Tensor,
    before: torch.Tensor,
    indices: torch.Tensor,
    final: torch.Tensor,
    tol: float,
) -> None:
    """The sequences' rows hold their final states; padding and other rows are untouched."""
    live = indices >= 0
    rows = indices[live].long()
    assert relative_error(cache[rows], final[live]) <= tol
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    untouched[rows] = False
    assert torch.equal(cache[untouched], before[untouched])


def check_scan(scan: Scan, dtype: torch.dtype, tol: float, device: str, cached: bool) -> None:
    """Random inputs of the shape, x, B and C strided views of one buffer as the conv
    output gives them; states from and to a cache (`cached`) or zeros and none kept."""
    num_tokens, num_seqs = sum(scan.lens), len(scan.lens)
    heads, groups, state = scan.heads, scan.groups, scan.state
    width = heads * scan.head_dim + 2 * groups * state
    xBC = torch.randn(num_tokens, width, device=device).to(dtype)
    x = xBC[:, : heads * scan.head_dim].unflatten(1, (heads, scan.head_dim))
    B = xBC[:, heads * scan.head_dim : -groups * state].unflatten(1, (groups, state))
    C = xBC[:, -groups * state :].unflatten(1, (groups, state))
    raw_dt = torch.randn(num_tokens, heads, device=device)
    dt = time_step(raw_dt, torch.randn(heads, device=device), (0.0, float("inf")))
    A = -4 * torch.rand(heads, device=device)
    D = torch.randn(heads, device=device)
    cu = cu_seqlens(scan.lens)
    layout = chunk_layout(tuple(cu), scan.chunk, torch.device(device))
    cache = torch.randn(num_seqs + 3, heads, scan.head_dim, state, device=device)
    indices, carry = state_rows(num_seqs, device)
    initial = initial_rows(cache, indices, carry) if cached else cache[:num_seqs] * 0
    y_ref, final_ref = ssd_varlen(x, dt, A, B, C, D, initial, cu, scan.chunk)
    if cached:
        before = cache.clone()
        y = ssd_prefill(x, dt, A, B, C, D, layout, cache, indices, carry)
        assert_rows_written(cache, before, indices, final_ref, tol)
    else:
        y = ssd_prefill(x, dt, A, B, C, D, layout)
    assert y.dtype == torch.float32
    assert relative_error(y, y_ref) < tol, (scan, relative_error(y, y_ref))


def check_conv(lens: tuple[int, ...], width: int, dtype: torch.dtype, device: str) -> None:
    """The conv of strided rows with its states in a cache, against the torch conv; the
    same without a cache (zeros, nothing kept). Sequences shorter than the window reach
    back into their old state."""
    channels = 40
    cu = cu_seqlens(lens)
    rows = torch.randn(sum(lens), channels + 8, device=device).to(dtype)
    x = rows[:, 3 : 3 + channels]
    weight = torch.randn(channels, width, device=device).to(dtype)
    bias = torch.randn(channels, device=device).to(dtype)
    cache = torch.randn(len(lens) + 3, channels, width - 1, device=device).to(dtype)
    indices, carry = state_rows(len(lens), device)
    cu_device = torch.tensor(cu, dtype=torch.int32, device=device)
    layout = chunk_layout(tuple(cu), 16, torch.device(device))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    initial = initial_rows(cache, indices, carry).to(dtype)
    out_ref, final_ref = causal_conv_varlen(x, weight, bias, initial, cu_device)
    before = cache.clone()
    out = causal_conv_prefill(x, weight, bias, layout, cu_device, cache, indices, carry)
    assert out.dtype == dtype
    assert relative_error(out, out_ref) < tol
    assert_rows_written(cache, before, indices, final_ref, 0)
    zeros = initial * 0
    out_ref, _ = causal_conv_varlen(x, weight, None, zeros, cu_device)
    assert relative_error(causal_conv_prefill(x, weight, None, layout, cu_device), out_ref) < tol


def check_mixer(dtype: torch.dtype, device: str) -> None:
    """A Mamba2 mixer's prefill on the GPU path (`_prefill_triton`) against its torch path
    on the same bound states: the same outputs and the same states left in the rows."""
    dims = Mamba2Dims(
        hidden_size=32, num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4,
        chunk_size=16, eps=1e-5, use_bias=False, use_conv_bias=True,
        time_step_limit=(0.0, float("inf")),
    )  # fmt: skip
    mixer = Mamba2Mixer(dims).to(device)
    with torch.no_grad():
        for param in mixer.parameters():
            param.normal_()
    lens = (5, 40, 1, 17)
    indices, carry = state_rows(len(lens), device)
    cu = torch.tensor(cu_seqlens(lens), dtype=torch.int32, device=device)
    metadata = MambaMetadata(True, cu, indices[None], carry)
    xBC = torch.randn(sum(lens), dims.conv_dim, device=device).to(dtype)
    dt = torch.randn(sum(lens), dims.num_heads, device=device).to(dtype)
    rows = len(lens) + 3
    ssm_state = torch.randn(rows, dims.num_heads, dims.head_dim, dims.state_size, device=device)
    conv_state = torch.randn(rows, dims.conv_dim, dims.conv_kernel - 1, device=device).to(dtype)
    results = []
    for path in (mixer._forward_torch, mixer._prefill_triton):
        mixer.ssm_state, mixer.conv_state = ssm_state.clone(), conv_state.clone()
        results.append((path(xBC, dt, metadata), mixer.ssm_state, mixer.conv_state))
    for out, expected in zip(*results, strict=True):
        assert relative_error(out, expected) < 1e-5


def test_interpreted() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_chunk_layout() -> None:
    """Chunks never span two sequences; short batches get short (power-of-two) chunks."""
    layout = chunk_layout((0, 5, 45, 46), 16, torch.device("cpu"))
    assert layout.chunk == 16
    assert layout.starts.tolist() == [0, 5, 21, 37, 45]
    assert layout.lengths.tolist() == [5, 16, 16, 8, 1]
    assert layout.seqs.tolist() == [0, 1, 1, 1, 2]
    assert layout.offsets.tolist() == [0, 0, 16, 32, 0]
    assert layout.seq_first_chunk.tolist() == [0, 1, 4, 5]
    assert chunk_layout((0, 3, 8), 256, torch.device("cpu")).chunk == 8


@pytest.mark.gpu
@pytest.mark.parametrize("scan", GPU_SCANS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_against_torch_scan_gpu(scan: Scan, dtype: torch.dtype) -> None:
    for cached in (True, False):
        torch.manual_seed(0)
        check_scan(scan, dtype, 1e-4 if dtype == torch.float32 else 1e-3, "cuda", cached)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixer_prefill_paths_agree_gpu(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    check_mixer(dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_against_torch_gpu(width: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    check_conv((1, 2, 70, 3, 300), width, dtype, "cuda")


if __name__ == "__main__":
    backport_interpreter_index_fix()
    interpreter_rounds_bf16_to_nearest()
    interpreter_dots_bf16_as_numbers()
    patch_interpreter_masks()
    for dtype in (torch.float32, torch.bfloat16):
        for scan, cached in itertools.product(CPU_SCANS, (True, False)):
            torch.manual_seed(0)
            check_scan(scan, dtype, 1e-5, "cpu", cached)
        for width in (4, 2):
            check_conv((1, 2, 20, 3, 40), width, dtype, "cpu")
        torch.manual_seed(0)
        check_mixer(dtype, "cpu")
