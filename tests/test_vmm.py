"""ExtensibleTensor and the granule bookkeeping beneath it (growth and explicit shrinking),
on the host backend and CUDA."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from extkv import ExtensibleTensor
from extkv.engine.host_memory import resident_bytes
from extkv.vmm import (
    HostBackend,
    VirtualMemoryError,
    VirtualMemoryOutOfMemory,
    allocation_granularity,
    free_physical_bytes,
)
from extkv.vmm.granules import MAX_ALLOCATION_BYTES

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
MiB = 1 << 20


def granule(device: str) -> int:
    return allocation_granularity(device)


def random_bytes(n: int, device: str | torch.device) -> torch.Tensor:
    return torch.randint(1, 256, (n,), dtype=torch.uint8, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_grows_without_moving(device: str) -> None:
    g = granule(device)
    buf = ExtensibleTensor(5 * g + 123, device)
    assert buf.full_view().numel() == 5 * g + 123
    assert buf.capacity_bytes == 6 * g
    assert buf.full_view().data_ptr() == buf.base_ptr
    first = random_bytes(g // 2, device)
    buf.resize_(g // 2).copy_(first)
    for size in (g, 3 * g + 7, 5 * g + 123):
        tensor = buf.resize_(size)
        assert tensor.data_ptr() == buf.base_ptr == buf.full_view().data_ptr()
        assert buf.tensor.numel() == size == buf.num_bytes
        assert torch.equal(tensor[: g // 2], first)
    buf.tensor[-1] = 7  # the last byte is committed
    assert buf.committed_bytes == 6 * g
    buf.free()


@pytest.mark.parametrize("device", DEVICES)
def test_append_and_rejections(device: str) -> None:
    g = granule(device)
    buf = ExtensibleTensor(2 * g, device)
    buf.append(g)
    buf.append(10)
    assert buf.num_bytes == g + 10
    with pytest.raises(ValueError, match="grow-only"):
        buf.resize_(g)
    with pytest.raises(ValueError, match="exceeds the segment capacity"):
        buf.resize_(2 * g + 1)
    with pytest.raises(ValueError, match="negative"):
        buf.append(-1)
    assert buf.num_bytes == g + 10  # failed calls changed nothing
    buf.free()


@pytest.mark.parametrize("device", DEVICES)
def test_two_segments_grow_in_lockstep_and_zero_only_new_bytes(device: str) -> None:
    g = granule(device)
    buf = ExtensibleTensor(8 * g, device, num_segments=2)
    cap = buf.segment_capacity_bytes
    assert cap == 4 * g
    view = buf.full_view()
    buf.resize_per_segment_(g + 5, zero_new=True)
    assert buf.num_bytes == 2 * (g + 5) and buf.bytes_per_segment == g + 5
    old0, old1 = random_bytes(g + 5, device), random_bytes(g + 5, device)
    view[: g + 5] = old0
    view[cap : cap + g + 5] = old1
    # Poison the tail of the committed granules: zero_new must not touch it.
    view[g + 5 : 2 * g] = 0xAB
    view[cap + g + 5 : cap + 2 * g] = 0xCD
    buf.resize_per_segment_(3 * g, zero_new=True)
    assert torch.equal(view[: g + 5], old0)
    assert torch.equal(view[cap : cap + g + 5], old1)
    assert torch.all(view[g + 5 : 3 * g] == 0)
    assert torch.all(view[cap + g + 5 : cap + 3 * g] == 0)
    # Without zero_new, only the newly committed bytes change meaning; old bytes stay.
    view[3 * g - 1] = 9
    buf.resize_per_segment_(4 * g)
    view[4 * g - 1] = 1  # last byte of segment 0 writable
    view[8 * g - 1] = 2  # last byte of segment 1 writable
    assert view[3 * g - 1].item() == 9
    assert torch.equal(view[:10], old0[:10])
    buf.free()


@pytest.mark.parametrize("device", DEVICES)
def test_zero_new_leaves_bytes_committed_beyond_the_prefix_alone(device: str) -> None:
    """The boundary granule is committed with segment 0 but belongs partly to segment 1:
    growing segment 0 with zero_new must not wipe what segment 1 holds there."""
    g = granule(device)
    buf = ExtensibleTensor(3 * g, device, num_segments=2)  # boundary at 1.5 granules
    cap = buf.segment_capacity_bytes
    view = buf.full_view()
    buf.resize_per_segment_(g // 4, zero_new=True)
    data = random_bytes(g // 4, device)
    view[cap : cap + g // 4] = data
    buf.resize_per_segment_(cap, zero_new=True)
    assert torch.equal(view[cap : cap + g // 4], data)
    buf.free()


@pytest.mark.parametrize("device", DEVICES)
def test_boundary_granule_is_mapped_once(device: str) -> None:
    g = granule(device)
    buf = ExtensibleTensor(3 * g, device, num_segments=2)
    cap = buf.segment_capacity_bytes
    assert cap == 3 * g // 2
    view = buf.full_view()
    # One byte in each segment touches granules 0 and 1: one run, one allocation.
    buf.resize_per_segment_(1, zero_new=True)
    assert (buf.num_allocations, buf.committed_bytes) == (1, 2 * g)
    # Segment 0 grows into granule 1 (already mapped by segment 1): nothing new to map.
    buf.resize_per_segment_(g // 2)
    assert (buf.num_allocations, buf.committed_bytes) == (1, 2 * g)
    head, tail = random_bytes(g // 2, device), random_bytes(g // 2, device)
    view[: g // 2] = head
    view[cap : cap + g // 2] = tail
    buf.resize_per_segment_(cap, zero_new=True)
    assert (buf.num_allocations, buf.committed_bytes) == (2, 3 * g)
    assert torch.equal(view[: g // 2], head)
    assert torch.equal(view[cap : cap + g // 2], tail)
    view[-1] = 3
    buf.free()
    assert (buf.num_allocations, buf.committed_bytes) == (0, 0)


def test_contiguous_unmapped_granules_are_one_allocation() -> None:
    backend = HostBackend()
    g = backend.granularity
    buf = ExtensibleTensor(64 * g, "cpu", backend=backend)
    buf.resize_(40 * g)
    assert buf.num_allocations == 1 and backend.committed_bytes == 40 * g
    buf.resize_(40 * g + 1)
    assert buf.num_allocations == 2
    buf.free()
    assert backend.committed_bytes == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_bytes": 10, "num_segments": 3}, "divisible by num_segments"),
        ({"max_num_bytes": -1}, "max_num_bytes must be >= 0"),
        ({"max_num_bytes": 10, "num_segments": 0}, "num_segments must be an int >= 1"),
        ({"max_num_bytes": 10, "num_segments": -2}, "num_segments must be an int >= 1"),
        ({"max_num_bytes": 1.5}, "max_num_bytes must be an int"),
        ({"max_num_bytes": 10, "device": "tpu"}, "device must be"),
        ({"max_num_bytes": 10, "device": "cuda:x"}, "device must be"),
        ({"max_num_bytes": 10, "device": -1}, "device must be"),
        ({"max_num_bytes": 10, "device": torch.device("meta")}, "device must be"),
    ],
)
def test_invalid_construction(kwargs: dict, match: str) -> None:
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=match):
        ExtensibleTensor(**kwargs)


def test_invalid_usage_of_multi_segment_buffer() -> None:
    buf = ExtensibleTensor(4 * MiB, "cpu", num_segments=2)
    with pytest.raises(ValueError, match="num_segments == 1"):
        _ = buf.tensor
    with pytest.raises(ValueError, match="num_segments == 1"):
        buf.resize_(10)
    buf.resize_per_segment_(100)
    with pytest.raises(ValueError, match="grow-only"):
        buf.resize_per_segment_(99)
    with pytest.raises(ValueError, match="exceeds the segment capacity"):
        buf.resize_per_segment_(2 * MiB + 1)
    with pytest.raises(ValueError, match="bytes_per_segment must be >= 0"):
        buf.resize_per_segment_(-5)
    assert buf.bytes_per_segment == 100
    buf.free()
    with pytest.raises(RuntimeError, match="freed"):
        buf.full_view()


def test_failed_commit_maps_nothing() -> None:
    backend = HostBackend(commit_limit_bytes=3 * (2 * MiB))
    buf = ExtensibleTensor(8 * (2 * MiB), "cpu", num_segments=2, backend=backend)
    buf.resize_per_segment_(2 * MiB)  # granules 0 and 4
    with pytest.raises(VirtualMemoryOutOfMemory, match="commit limit"):
        buf.resize_per_segment_(4 * MiB)  # would need 2 more granules, only 1 allowed
    assert buf.bytes_per_segment == 2 * MiB
    assert buf.committed_bytes == backend.committed_bytes == 4 * MiB
    buf.free()
    assert backend.committed_bytes == 0


def test_host_commits_are_real() -> None:
    """Writing past the committed prefix must fault, as it would on the GPU."""
    script = textwrap.dedent(
        """
        from extkv import ExtensibleTensor
        buf = ExtensibleTensor(8 << 20, "cpu")
        buf.resize_(100)
        view = buf.full_view()
        view[:100] = 1          # committed: fine
        print("committed ok", flush=True)
        view[(4 << 20) + 1] = 1  # never committed: must fault
        print("NOT REACHED", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "committed ok" in proc.stdout
    assert "NOT REACHED" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV


def _mapping_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.parametrize("device", DEVICES)
def test_no_leak_over_many_cycles(device: str) -> None:
    g = granule(device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
    maps_before = _mapping_count()
    last = None
    for i in range(500):
        buf = ExtensibleTensor(4 * g, device, num_segments=2)
        buf.resize_per_segment_(1 + i % (2 * g - 1), zero_new=i % 2 == 0)
        buf.free()
        buf.free()  # idempotent
        assert buf.committed_bytes == 0
        last = buf
    assert last is not None and last.num_allocations == 0
    if cuda:
        torch.cuda.synchronize()
        assert abs(torch.cuda.mem_get_info()[0] - free_before) <= g
    else:
        assert _mapping_count() <= maps_before + 2


# --- shrinking -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_shrink_keeps_the_base_and_the_kept_bytes_and_gives_granules_back(device: str) -> None:
    g = granule(device)
    buf = ExtensibleTensor(8 * g, device, num_segments=2)
    cap = buf.segment_capacity_bytes
    view = buf.full_view()
    buf.resize_per_segment_(cap, zero_new=True)  # one run over both segments: one allocation
    assert (buf.num_allocations, buf.committed_bytes) == (1, 8 * g)
    head0, head1 = random_bytes(g + 7, device), random_bytes(g + 7, device)
    view[: g + 7] = head0
    view[cap : cap + g + 7] = head1
    buf.shrink_per_segment_(g + 7)  # granules 0-1 and 4-5 stay: the allocation is cut twice
    assert buf.base_ptr == buf.full_view().data_ptr() == view.data_ptr()
    assert buf.bytes_per_segment == g + 7 and buf.num_bytes == 2 * (g + 7)
    assert (buf.num_allocations, buf.committed_bytes) == (2, 4 * g)
    assert torch.equal(view[: g + 7], head0) and torch.equal(view[cap : cap + g + 7], head1)
    buf.resize_per_segment_(3 * g, zero_new=True)  # grows back under the same addresses
    assert torch.equal(view[: g + 7], head0) and torch.equal(view[cap : cap + g + 7], head1)
    assert torch.all(view[g + 7 : 3 * g] == 0) and torch.all(view[cap + g + 7 : cap + 3 * g] == 0)
    assert buf.committed_bytes == 6 * g
    buf.shrink_per_segment_(0)
    assert (buf.num_allocations, buf.committed_bytes, buf.num_bytes) == (0, 0, 0)
    buf.resize_per_segment_(1)
    view[cap] = 1
    buf.free()


def test_shrink_keeps_a_boundary_granule_while_either_segment_needs_it() -> None:
    backend = HostBackend()
    g = backend.granularity
    buf = ExtensibleTensor(3 * g, "cpu", num_segments=2, backend=backend)  # boundary at 1.5 g
    cap = buf.segment_capacity_bytes
    view = buf.full_view()
    buf.resize_per_segment_(cap)
    data = random_bytes(g // 4, "cpu")
    view[cap : cap + g // 4] = data
    buf.shrink_per_segment_(g // 4)  # segment 1's prefix still lies in granule 1
    assert buf.committed_bytes == backend.committed_bytes == 2 * g
    assert torch.equal(view[cap : cap + g // 4], data)
    buf.shrink_per_segment_(0)
    assert buf.committed_bytes == backend.committed_bytes == 0
    buf.free()


def test_shrink_is_explicit_and_checked() -> None:
    buf = ExtensibleTensor(4 * MiB, "cpu", num_segments=2)
    buf.resize_per_segment_(100)
    with pytest.raises(ValueError, match="grow-only"):
        buf.resize_per_segment_(50)  # resize_per_segment_ never shrinks
    with pytest.raises(ValueError, match="cannot grow"):
        buf.shrink_per_segment_(101)
    with pytest.raises(ValueError, match="bytes_per_segment must be >= 0"):
        buf.shrink_per_segment_(-1)
    buf.shrink_per_segment_(100)  # the same size: nothing to do
    assert buf.bytes_per_segment == 100 and buf.committed_bytes == 2 * (2 * MiB)
    buf.free()
    with pytest.raises(RuntimeError, match="freed"):
        buf.shrink_per_segment_(0)


def test_shrink_gives_host_pages_back() -> None:
    """The host backend really drops the pages: the resident set falls by what was freed."""
    buf = ExtensibleTensor(64 * MiB, "cpu")
    buf.resize_(64 * MiB).fill_(1)  # every page resident
    before = resident_bytes()
    buf.shrink_per_segment_(MiB)
    assert before - resident_bytes() >= 56 * MiB
    assert int(buf.tensor.sum()) == MiB  # the kept bytes are still there
    buf.free()


def test_touching_given_back_memory_faults() -> None:
    script = textwrap.dedent(
        """
        from extkv import ExtensibleTensor
        buf = ExtensibleTensor(8 << 20, "cpu")
        view = buf.resize_(8 << 20)
        view[(6 << 20)] = 1
        buf.shrink_per_segment_(100)
        view[:100] = 1           # kept: fine
        print("kept ok", flush=True)
        view[(6 << 20)] = 1      # given back: must fault
        print("NOT REACHED", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "kept ok" in proc.stdout
    assert "NOT REACHED" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV


class _NoRoomToSplit(HostBackend):
    """A backend that cannot split an allocation (as CUDA when the kept copy does not fit)."""

    def unmap_part(self, address: int, size: int, handle: object, keep: list) -> list:
        raise VirtualMemoryOutOfMemory("no memory for the kept copy")


def test_shrink_without_memory_to_split_keeps_the_allocation_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = _NoRoomToSplit()
    g = backend.granularity
    buf = ExtensibleTensor(4 * g, "cpu", backend=backend)
    buf.resize_(4 * g).fill_(3)
    assert buf.num_allocations == 1
    buf.shrink_per_segment_(g)
    assert buf.bytes_per_segment == g  # logically smaller, physically all kept
    assert buf.committed_bytes == backend.committed_bytes == 4 * g
    assert "splitting their allocation needs memory" in caplog.text
    assert int(buf.tensor.sum()) == 3 * g
    buf.shrink_per_segment_(0)  # wholly outside now: released without a split
    assert buf.committed_bytes == backend.committed_bytes == 0
    buf.free()


class _RecordsSplits(HostBackend):
    """The host backend, noting the bytes each split would copy on CUDA (its kept pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept_bytes: list[int] = []

    def unmap_part(self, address: int, size: int, handle: object, keep: list) -> list:
        self.kept_bytes.append(sum(length for _, length in keep))
        return super().unmap_part(address, size, handle, keep)


def test_allocations_are_cut_at_the_grid_so_a_shrink_copies_at_most_one() -> None:
    backend = _RecordsSplits()
    g, grid = backend.granularity, MAX_ALLOCATION_BYTES
    buf = ExtensibleTensor(4 * grid, "cpu", backend=backend, num_segments=2)
    buf.resize_per_segment_(grid + grid // 2)  # segment 1 starts at 2 grid cells
    # Segment 0: cells 0 and half of 1; segment 1: cell 2 and half of 3.
    assert buf.num_allocations == 4
    assert buf.committed_bytes == backend.committed_bytes == 3 * grid
    buf.shrink_per_segment_(grid + 3 * g)
    # Each segment's cut falls in one allocation, of which 3 granules stay (not 1.5 GiB).
    assert backend.kept_bytes == [3 * g, 3 * g]
    assert buf.committed_bytes == backend.committed_bytes == 2 * grid + 6 * g
    buf.free()
    assert backend.committed_bytes == 0


def _granules_touched(prefix: int, segment: int, num_segments: int, g: int) -> int:
    touched: set[int] = set()
    for i in range(num_segments):
        start = i * segment
        if prefix:
            touched.update(range(start // g, -(-(start + prefix) // g)))
    return len(touched)


class GrowthMachine(RuleBasedStateMachine):
    """Random grow and shrink sequences over 1-4 segments against a plain bytes model;
    the granules mapped are always exactly those some committed byte lies in."""

    @initialize(
        num_segments=st.integers(1, 4),
        granules_per_segment=st.integers(1, 3),
        extra=st.integers(0, 4096),
    )
    def create(self, num_segments: int, granules_per_segment: int, extra: int) -> None:
        g = 2 * MiB
        self.segment = granules_per_segment * g // 2 + extra  # deliberately not granule-aligned
        self.backend = HostBackend()
        self.buf = ExtensibleTensor(
            self.segment * num_segments, "cpu", num_segments, backend=self.backend
        )
        self.model = [bytearray() for _ in range(num_segments)]

    @rule(fraction=st.floats(0, 1))
    def shrink(self, fraction: float) -> None:
        new = int(self.buf.bytes_per_segment * fraction)
        self.buf.shrink_per_segment_(new)
        for model in self.model:
            del model[new:]

    @invariant()
    def granules_match(self) -> None:
        g = self.backend.granularity
        want = _granules_touched(self.buf.bytes_per_segment, self.segment, len(self.model), g)
        assert self.buf.committed_bytes == self.backend.committed_bytes == want * g

    @rule(fraction=st.floats(0, 1), zero_new=st.booleans(), seed=st.integers(0, 2**31))
    def grow(self, fraction: float, zero_new: bool, seed: int) -> None:
        old = self.buf.bytes_per_segment
        new = old + int((self.segment - old) * fraction)
        self.buf.resize_per_segment_(new, zero_new=zero_new)
        view = self.buf.full_view()
        gen = torch.Generator().manual_seed(seed)
        for i, model in enumerate(self.model):
            lo = i * self.segment
            if zero_new:
                model.extend(bytes(new - old))
            else:  # fresh bytes are unspecified: give them known contents
                fresh = torch.randint(0, 256, (new - old,), dtype=torch.uint8, generator=gen)
                view[lo + old : lo + new] = fresh
                model.extend(fresh.numpy().tobytes())

    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        size = self.buf.bytes_per_segment
        if size == 0:
            return
        i = data.draw(st.integers(0, len(self.model) - 1))
        offset = data.draw(st.integers(0, size - 1))
        value = data.draw(st.integers(0, 255))
        self.buf.full_view()[i * self.segment + offset] = value
        self.model[i][offset] = value

    @invariant()
    def contents_match(self) -> None:
        view = self.buf.full_view()
        for i, model in enumerate(self.model):
            lo = i * self.segment
            got = view[lo : lo + len(model)].numpy().tobytes()
            assert got == bytes(model)

    def teardown(self) -> None:
        self.buf.free()


TestGrowthMachine = GrowthMachine.TestCase
TestGrowthMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


@pytest.mark.gpu
def test_cuda_works_before_torch_touches_cuda() -> None:
    """A fresh process whose first CUDA call is ours: the backend brings up the context."""
    script = textwrap.dedent(
        """
        from extkv import ExtensibleTensor
        buf = ExtensibleTensor(64 << 20, "cuda:0", num_segments=2)
        buf.resize_per_segment_(1 << 20, zero_new=True)
        view = buf.full_view()
        view[:10] = 5
        assert int(view[:10].sum()) == 50 and int(view[32 << 20 : (33 << 20)].sum()) == 0
        buf.free()
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.gpu
def test_cuda_kernels_see_committed_memory() -> None:
    buf = ExtensibleTensor(256 * MiB, "cuda")
    floats = buf.resize_(128 * MiB).view(torch.float32)
    floats.copy_(torch.arange(floats.numel(), device="cuda", dtype=torch.float32))
    buf.resize_(256 * MiB)
    assert torch.equal(floats, torch.arange(floats.numel(), device="cuda", dtype=torch.float32))
    buf.free()


def test_free_physical_bytes_follows_commits() -> None:
    backend = HostBackend(commit_limit_bytes=8 * MiB)
    assert free_physical_bytes("cpu", backend) == 8 * MiB
    buf = ExtensibleTensor(8 * MiB, "cpu", backend=backend)
    buf.resize_(3 * MiB)  # two granules
    assert free_physical_bytes("cpu", backend) == 4 * MiB
    buf.free()
    assert free_physical_bytes("cpu", backend) == 8 * MiB
    assert free_physical_bytes("cpu") is None  # plain host memory: no bound of ours


@pytest.mark.gpu
def test_cuda_free_physical_bytes_matches_torch() -> None:
    torch.cuda.synchronize()
    ours = free_physical_bytes("cuda")
    assert ours is not None
    assert abs(ours - torch.cuda.mem_get_info()[0]) <= 64 * MiB


def test_zero_byte_buffer_reserves_nothing() -> None:
    buf = ExtensibleTensor(0, "cpu")
    assert buf.capacity_bytes == 0 and buf.full_view().numel() == 0
    assert buf.resize_(0).numel() == 0
    with pytest.raises(ValueError, match="exceeds the segment capacity"):
        buf.resize_(1)
    buf.free()
    buf.free()
    assert allocation_granularity("cpu") == 2 * MiB


@pytest.mark.gpu
@pytest.mark.parametrize("device", [0, "cuda", "cuda:0", torch.device("cuda"), None])
def test_cuda_device_spellings(device: object) -> None:
    buf = ExtensibleTensor(4 * MiB, device)
    assert buf.device == torch.device("cuda", 0)
    buf.resize_(1).fill_(3)
    assert buf.tensor.item() == 3
    buf.free()


@pytest.mark.gpu
def test_backend_and_device_must_agree() -> None:
    with pytest.raises(ValueError, match="disagrees with the backend"):
        ExtensibleTensor(4 * MiB, "cuda", backend=HostBackend())


def test_cuda_backend_without_cuda_bindings_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuda-bindings is an extra: without it the CUDA backend says how to install it."""
    from extkv.vmm import tensor

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import now fails
    monkeypatch.delitem(sys.modules, "extkv.vmm.cuda", raising=False)
    tensor._shared_backend.cache_clear()
    try:
        with pytest.raises(VirtualMemoryError, match=r"pip install 'extkv\[cuda\]'"):
            tensor._shared_backend(torch.device("cuda", 0))
    finally:
        tensor._shared_backend.cache_clear()
