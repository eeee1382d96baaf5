"""Where a batch-1 decode layer's time goes, inside its kernels: %globaltimer stamps.

    python benchmarks/layer_stamps.py [--context 512] [--qkv one_row|gemv]

A profiler sees a kernel's start and end; with PDL a kernel starts long before its
inputs exist, so its length says little. This copies `src/` to a temporary folder,
puts a `%globaltimer` store at each point below into the layer's three kernels (the
norm + qkv projection, the decode attention kernel, the MLP kernel), each store made to
wait on the value computed just before it, and replays bench_persistent's 28 layers in
a CUDA graph. Each line: microseconds after the previous kernel's last stamp at which
the first and the last program got to the point (mean over layers 1-27, 25 replays).

The patch finds its places by text: `patch_kernels` raises where the kernels changed
under it (tests/test_benchmarks.py checks that it applies to the tree).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

SLOTS = 16  # int64 stamps a program
POINTS = {  # launch name: its stamps, in slot order
    "qkv": ["entry", "issued", "waited", "normed", "projected"],  # the GEMV: no "normed"
    "attn": ["entry", "issued", "waited", "q", "acc", "arrived", "merged"],
    "mlp": ["entry", "issued", "waited", "oproj", "bar1", "act", "bar2", "down"],
}

PROBE_MODULE = '''
import torch
import triton
import triton.language as tl

SLOTS = {slots}
BUFFER = []
LAUNCHES = []  # (name, first slot, programs) of each launch since `reset`


def take(name, programs):
    """This launch's slots: `programs` x SLOTS int64 of one buffer."""
    if not BUFFER:
        BUFFER.append(torch.zeros(1 << 22, dtype=torch.int64, device="cuda"))
    first = LAUNCHES[-1][1] + LAUNCHES[-1][2] * SLOTS if LAUNCHES else 0
    LAUNCHES.append((name, first, programs))
    return BUFFER[0][first:]


@triton.jit
def stamp(pp, slot: tl.constexpr, after):
    """%globaltimer into slot `slot` of this program's, once `after` (fp32) exists."""
    operand = (tl.full([1], 0.0, tl.float32) + after).to(tl.int32, bitcast=True)
    now = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [operand], dtype=tl.int64, is_pure=False,
        pack=1,
    )
    tl.store(pp + slot + tl.arange(0, 1), now)


@triton.jit
def of1(x):
    return tl.sum(x.to(tl.float32), axis=0)


@triton.jit
def of2(x):
    return tl.sum(tl.sum(x.to(tl.float32), axis=1), axis=0)
'''

IMPORT = "from extkv.kernels.probe import of1, of2, stamp, take\n"
PROGRAM = (
    "    pp = probe_ptr + (tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1)"
    f" + tl.num_programs(1) * tl.program_id(2))) * {SLOTS}\n"
)
WAIT = "    wait_for_previous_grid(USE_PDL)\n"


def before(line: str, slot: int, value: str = "0.0") -> tuple[str, str]:
    """A stamp just before `line` (whole lines, the stamp at the first one's indent)."""
    indent = line[: len(line) - len(line.lstrip())]
    return line, f"{indent}stamp(pp, {slot}, {value})\n{line}"


def after(line: str, slot: int, value: str) -> tuple[str, str]:
    """A stamp just after `line`, at its indent, once `value` exists."""
    indent = line[: len(line) - len(line.lstrip())]
    return line, f"{line}{indent}stamp(pp, {slot}, {value})\n"


def kernel_edits(kernel: str, first_arg: str, start: str, launch: str, take: str) -> list:
    """The probe pointer as `kernel`'s first argument, given at its `launch` (the grid and
    the first argument's line), the program's slots and its entry stamp after `start`,
    and stamps either side of its wait."""
    grid, argument = launch.split("\n")
    indent = argument[: len(argument) - len(argument.lstrip())]
    return [
        (f"def {kernel}(\n    {first_arg},", f"def {kernel}(\n    probe_ptr,\n    {first_arg},"),
        (f"{kernel}{launch}", f"{kernel}{grid}\n{indent}take({take}),\n{argument}"),
        (start, f"{start}{PROGRAM}    stamp(pp, 0, 0.0)\n"),
        before(WAIT, 1),
        after(WAIT, 2, "0.0"),
    ]


def edits() -> dict[str, list[tuple[str, str]]]:
    """Per kernel file, (text, replacement) pairs: each text must occur exactly once."""
    return {
        "norm_linear.py": [
            *kernel_edits(
                "_norm_linear_kernel", "x_ptr", "    row0 = pid * (R1 + R2)\n",
                "[(plan.programs,)](\n        x,", "'qkv', plan.programs",
            ),
            before("    y1, y2 = matvec(w11, w12, w21, w22, n1, n2)\n", 3, "of1(n1)"),
            before("    if HAS_BIAS:  # added in fp32", 4, "of1(y1)"),
        ],
        "gemv.py": [
            *kernel_edits(
                "_gemv_kernel", "x_ptr", "    pid_k = tl.program_id(1)\n",
                "[(tiles, config.split_k)](\n        x,", "'qkv', tiles * config.split_k",
            ),
            before("    if SPLIT_K == 1:\n", 4, "of2(acc)"),
        ],
        "decode_attention.py": [
            *kernel_edits(
                "_decode_attention_kernel", "out_ptr", "    kv_head = tl.program_id(2)\n",
                "[(splits, num_seqs, num_kv_heads)](\n        out,",
                "'attn', splits * num_seqs * num_kv_heads",
            ),
            before("    row_max = tl.full([BLOCK_M]", 3, "of2(q)"),
            before("    safe_sum = tl.where(", 4, "of2(acc)"),
            (
                '        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:\n',
                '        arrived = tl.atomic_add(counter, 1, sem="acq_rel")\n'
                "        stamp(pp, 5, arrived.to(tl.float32))\n"
                "        if arrived == NUM_SPLITS - 1:\n",
            ),
            before("            tl.atomic_xchg(counter, 0)", 6),
        ],
        "gated_mlp.py": [
            *kernel_edits(
                "_gated_mlp_kernel", "attn_ptr", "    inner_row = pid * (RI1 + RI2)\n",
                "[(plan.programs,)](\n            x,", "'mlp', plan.programs",
            ),
            after(
                "        store_rows(x_ptr, hidden_row, x1, x2, RO1, RO2)  # rounded as the GEMV's"
                " output\n", 3, "of1(x1)",
            ),
            before("        n1, n2 = rms_normed_row(", 4),
            after("        store_rows(act_ptr, inner_row, act1, act2, RI1, RI2)\n", 5, "of1(act1)"),
            before("        h1, h2 = load_vector(act_ptr", 6),
            after("        store_rows(y_ptr, hidden_row, y1, y2, RO1, RO2)\n", 7, "of1(y1)"),
        ],
    }  # fmt: skip


def patch_kernels(src: Path, dest: Path) -> None:
    """A copy of `src` (the folder holding `extkv`) in `dest`, its kernels stamped."""
    shutil.copytree(src, dest, dirs_exist_ok=True)
    kernels = dest / "extkv" / "kernels"
    (kernels / "probe.py").write_text(PROBE_MODULE.replace("{slots}", str(SLOTS)))
    for name, pairs in edits().items():
        path = kernels / name
        text = path.read_text()
        anchor = "import triton.language as tl\n"
        text = text.replace(anchor, anchor + IMPORT, 1)
        for old, new in pairs:
            if text.count(old) != 1:
                raise ValueError(f"{name}: {old!r} occurs {text.count(old)} times, not once")
            text = text.replace(old, new)
        path.write_text(text)


def measure(context: int, one_row: bool) -> dict[tuple[str, str], tuple[float, float]]:
    """(launch, point): (first, last) us after the previous launch's last stamp."""
    import numpy as np
    import torch

    from bench_persistent import LAYERS, Layers
    from extkv.kernels import probe

    torch.manual_seed(0)
    layers = Layers(context)
    run = lambda: [layers.layer(i, True, one_row) for i in range(LAYERS)]  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    probe.LAUNCHES.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    launches, buffer = list(probe.LAUNCHES), probe.BUFFER[0]
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for replay in range(30):
        buffer.zero_()
        graph.replay()
        stamps = buffer.cpu().numpy().astype(np.float64)
        if replay < 5:
            continue
        previous_end = layer_end = None
        for index, (name, first, programs) in enumerate(launches):
            block = stamps[first : first + programs * SLOTS].reshape(programs, SLOTS)
            points = POINTS[name]
            block = block[:, : len(points)]
            seen = block > 0
            lo = np.where(seen, block, np.inf).min(0)
            hi = np.where(seen, block, -np.inf).max(0)
            end = hi[seen.any(0)].max()
            if index >= 3:  # layers 1-27: layer 0 has no kernel of this graph before it
                for j, point in enumerate(points):
                    if seen[:, j].any():
                        rows.setdefault((name, point), []).append(
                            (lo[j] - previous_end, hi[j] - previous_end)
                        )
                rows.setdefault((name, "end"), []).append((end - previous_end,) * 2)
                if name == "mlp":
                    rows.setdefault(("layer", "total"), []).append((end - layer_end,) * 2)
            layer_end = end if name == "mlp" else layer_end
            previous_end = end
    return {key: tuple(np.mean(values, axis=0) / 1e3) for key, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--qkv", choices=("one_row", "gemv"), default="one_row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        patch_kernels(Path(__file__).resolve().parents[1] / "src", Path(folder))
        sys.path.insert(0, folder)
        results = measure(args.context, args.qkv == "one_row")
    print(f"== stamps: qkv by {args.qkv}, {args.context}-token context, us (first / last program)")
    for (name, point), (first, last) in results.items():
        print(f"{name:6s} {point:9s} {first:8.2f} {last:8.2f}")


if __name__ == "__main__":
    main()
