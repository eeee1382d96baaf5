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


def layer_table(
    caplog: pytest.LogCaptureFixture, trace: list[tuple[str, float, float]]
) -> list[str]:
    """bench_step's layer table of 4 layers over `trace`: (name, start after the previous
    kernel's end, duration) each."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_step
    finally:
        sys.path.remove(str(BENCHMARKS))
    kernels, clock = [], 0.0
    for name, start_after, duration in trace:
        kernels.append({"name": name, "ts": clock + start_after, "dur": duration})
        clock = kernels[-1]["ts"] + duration
    with caplog.at_level("INFO", logger="bench_step"):
        bench_step.log_layer_table(kernels, 4)
    return [r.getMessage() for r in caplog.records]


def test_layer_table_adds_up_the_critical_path(caplog: pytest.LogCaptureFixture) -> None:
    """bench_step's layer table on a made-up trace: 2 kernels before the layers, 4 layers of
    3 kernels (the first a GEMV; the middle one overlapping the one before, as under PDL),
    a 2-kernel tail. Each kernel's share is from the previous kernel's end to its own."""
    lines = layer_table(
        caplog,
        [
            ("embed", 0, 1),
            ("tokens", 1, 1),
            *[("_gemv_kernel", 1, 4), ("_paged_attention", -2, 5), ("_merge", 0.5, 1)] * 4,
            ("nvjet", 1, 20),
            ("argmax", 1, 2),
        ],
    )
    # A layer: gemv ends 5 after the merge, attention 3 after the gemv, merge 1.5 after.
    assert "3 kernels a layer, 9.50 us a layer" in lines[0]
    assert "3.0 us before the first layer, 24.0 us after the last" in lines[0]
    assert [line.split(" us")[0].split()[-1] for line in lines[1:]] == [
        "5.00", "3.00", "1.50", "21.00", "3.00"
    ]  # fmt: skip


def test_layer_table_ends_layers_at_the_mlp_kernel(caplog: pytest.LogCaptureFixture) -> None:
    """Where each layer ends in the one-row MLP kernel, the layers are cut there: in a trace
    where only the first layer has a GEMV, layers run from the q/k norm to that kernel
    and the GEMV counts before the first layer."""
    lines = layer_table(
        caplog,
        [
            ("embed", 0, 1),
            ("_gemv_kernel", 1, 4),
            *[
                ("_qk_norm_rope_store", 1, 1),
                ("_paged_attention", 1, 3),
                ("_gated_mlp_kernel", 1, 10),
            ]
            * 4,
            ("nvjet", 1, 20),
        ],
    )
    assert "3 kernels a layer, 17.00 us a layer" in lines[0]
    assert "6.0 us before the first layer, 21.0 us after the last" in lines[0]
    assert [line.split(" us")[0].split()[-1] for line in lines[1:4]] == ["2.00", "4.00", "11.00"]


def test_layer_stamps_patch_applies_to_the_kernels(tmp_path: Path) -> None:
    """benchmarks/layer_stamps.py finds every place it stamps in today's kernels (it runs
    on the device only, where a patch that no longer applies would cost a call): each
    kernel gets its stamps and still parses."""
    import ast

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from layer_stamps import POINTS, patch_kernels
    finally:
        sys.path.remove(str(BENCHMARKS))
    patch_kernels(BENCHMARKS.parent / "src", tmp_path)
    kernels = tmp_path / "extkv" / "kernels"
    expected = {
        "norm_linear.py": len(POINTS["qkv"]),
        "gemv.py": len(POINTS["qkv"]) - 1,  # no "normed": the norm is inside its loop
        "decode_attention.py": len(POINTS["attn"]),
        "gated_mlp.py": len(POINTS["mlp"]),
    }
    for name, stamps in expected.items():
        text = (kernels / name).read_text()
        ast.parse(text)
        assert text.count("stamp(pp, ") == stamps, name
