"""Every benchmark with a `--smoke` mode runs to its table on the CPU. The benchmarks
otherwise first run on the device, whose minutes are few: one broken there costs a call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
WITH_SMOKE = sorted(p.name for p in BENCHMARKS.glob("bench_*.py") if "--smoke" in p.read_text())


def run_smoke(name: str, *extra: str) -> str:
    """`name --smoke` in a process of its own; its output, which must hold a table."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), "--smoke", *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "== " in done.stdout, done.stdout[-2000:]  # each table's title line
    return done.stdout


def test_the_smoke_modes_are_found() -> None:
    assert {"bench_step.py", "bench_host.py", "bench_block_pool.py"} <= set(WITH_SMOKE)


@pytest.mark.parametrize("name", [n for n in WITH_SMOKE if n != "bench_smollm2.py"])
def test_smoke(name: str) -> None:
    run_smoke(name)


def test_smollm2_smoke(smollm2_gguf: Path) -> None:
    """The real model, from the GGUF the tests use (skipped where it cannot be had)."""
    run_smoke("bench_smollm2.py", "--gguf", str(smollm2_gguf))
