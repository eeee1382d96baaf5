"""The Triton chunked SSD scan of a Mamba2 prefill (extkv.kernels.ssd_prefill) against
the torch scan it replaces on CUDA (`ssd_varlen`): under the Triton interpreter on the
CPU, compiled on the GPU.

Triton picks its interpreter when kernels are decorated, so the CPU checks run this file
as a script in a subprocess with `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from extkv.kernels.ssd_prefill import chunk_layout, ssd_prefill
from extkv.models.mamba2_ops import ssd_varlen, time_step
from helpers import (
    backport_interpreter_index_fix,
    interpreter_dots_bf16_as_numbers,
    interpreter_rounds_bf16_to_nearest,
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
    return float((out - ref).norm() / ref.norm())


def check_scan(scan: Scan, dtype: torch.dtype, tol: float, device: str) -> None:
    """Random inputs of the shape, x, B and C strided views of one buffer as the conv
    output gives them, random initial states: the same outputs and final states."""
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
    initial = torch.randn(num_seqs, heads, scan.head_dim, state, device=device)
    cu = [0]
    for n in scan.lens:
        cu.append(cu[-1] + n)
    y, final = ssd_prefill(x, dt, A, B, C, D, initial, cu, scan.chunk)
    y_ref, final_ref = ssd_varlen(x, dt, A, B, C, D, initial, cu, scan.chunk)
    assert y.dtype == final.dtype == torch.float32
    assert relative_error(y, y_ref) < tol, (scan, relative_error(y, y_ref))
    assert relative_error(final, final_ref) < tol, (scan, relative_error(final, final_ref))


def test_interpreted() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_chunk_layout() -> None:
    """Chunks never span two sequences; short batches get short (power-of-two) chunks."""
    starts, lens, first, chunk = chunk_layout([0, 5, 45, 46], 16, torch.device("cpu"))
    assert chunk == 16
    assert starts.tolist() == [0, 5, 21, 37, 45]
    assert lens.tolist() == [5, 16, 16, 8, 1]
    assert first.tolist() == [0, 1, 4, 5]
    assert chunk_layout([0, 3, 8], 256, torch.device("cpu"))[3] == 8


@pytest.mark.gpu
@pytest.mark.parametrize("scan", GPU_SCANS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_against_torch_scan_gpu(scan: Scan, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    check_scan(scan, dtype, 1e-4 if dtype == torch.float32 else 1e-3, "cuda")


if __name__ == "__main__":
    backport_interpreter_index_fix()
    interpreter_rounds_bf16_to_nearest()
    interpreter_dots_bf16_as_numbers()
    for dtype in (torch.float32, torch.bfloat16):
        for scan in CPU_SCANS:
            torch.manual_seed(0)
            check_scan(scan, dtype, 1e-5, "cpu")
