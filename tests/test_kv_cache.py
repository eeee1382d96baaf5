"""KV cache specs, layouts, configs and the legacy / extensible caches.

Buffers span several granules, so on the host backend a block the commit logic
missed is PROT_NONE and touching it crashes the test instead of passing.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from extkv.kv_cache import (
    AttentionLayout,
    FullAttentionSpec,
    KVCache,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
    bytes_per_block,
    get_layout,
    group_layers,
    hybrid_layout,
    layer_segments,
    make_kv_cache_config,
)
from extkv.vmm import HostBackend, allocation_granularity

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
MiB = 1 << 20

ATTN = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
NUM_BLOCKS = 2048  # 8 KiB pages: 16 MiB per layer, 4 granules per split half
# conv state then SSM state, 2560 bytes: padded to ATTN's page in a hybrid model
MAMBA = MambaSpec(16, shapes=((32, 4), (4, 8, 32)), dtypes=(torch.float32, torch.bfloat16))
HEADS_OUTER = AttentionLayout("heads_outer", ("kv", "heads", "blocks", "block_size", "head"))


def granule(device: str) -> int:
    return allocation_granularity(device)


def fill_(tensor: torch.Tensor) -> torch.Tensor:
    """Overwrite with nonzero random values; return a copy to compare against later."""
    tensor.copy_(torch.rand(tensor.shape, device=tensor.device) + 1)
    return tensor.clone()


def is_zero(tensor: torch.Tensor) -> bool:
    return bool((tensor == 0).all())


def attention_cache(layout: str, device: str, extensible: bool, **kwargs: object) -> KVCache:
    config = make_kv_cache_config([KVCacheGroup(["attn.0", "attn.1"], ATTN)], NUM_BLOCKS)
    layouts = dict.fromkeys(["attn.0", "attn.1"], get_layout(layout))
    return KVCache(config, layouts, device, extensible, **kwargs)


# --- specs and layouts -----------------------------------------------------------------


def test_page_sizes() -> None:
    assert ATTN.page_size_bytes == 2 * 16 * 2 * 64 * 2
    window = SlidingWindowSpec(16, 2, 64, torch.float16, sliding_window=128)
    assert window.page_size_bytes == ATTN.page_size_bytes
    assert MLASpec(16, 576, torch.bfloat16).page_size_bytes == 16 * 576 * 2
    assert MAMBA.page_size_bytes == 32 * 4 * 4 + 4 * 8 * 32 * 2
    assert MAMBA.state_offsets == (0, 512)
    padded = MambaSpec(16, MAMBA.shapes, MAMBA.dtypes, page_size_padded=8192)
    assert padded.page_size_bytes == 8192


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FullAttentionSpec(0, 2, 64, torch.float16), "block_size"),
        (lambda: FullAttentionSpec(16, 2, 64, "fp16"), "dtype"),
        (lambda: SlidingWindowSpec(16, 2, 64, torch.float16, sliding_window=0), "sliding_window"),
        (lambda: MLASpec(16, -1, torch.float16), "head_size"),
        (lambda: MambaSpec(16, ((4, 0),), (torch.float32,)), "shapes"),
        (lambda: MambaSpec(16, ((4,),), (torch.float32, torch.float32)), "dtypes"),
        (lambda: MambaSpec(16, ((3,), (4,)), (torch.float16, torch.float32)), "aligned"),
        (lambda: MambaSpec(16, ((4,),), (torch.float32,), page_size_padded=8), "page_size_padded"),
        (lambda: MambaSpec(16, ((4,),), (torch.float32,), page_size_padded=18), "multiple"),
    ],
)
def test_bad_spec_values(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_segment_counts() -> None:
    sizes = (NUM_BLOCKS, 16, 2, 64)
    kv_first_block_major = AttentionLayout(
        "kv_first", get_layout("split").dims, stride_order=(1, 0, 2, 3, 4)
    )
    assert get_layout("split").num_segments(*sizes) == 2
    assert get_layout("block_major").num_segments(*sizes) == 1
    assert kv_first_block_major.num_segments(*sizes) == 1
    assert get_layout("mla").num_segments(*sizes) == 1
    assert layer_segments(MAMBA, None, NUM_BLOCKS) == 1
    assert hybrid_layout(get_layout("split")).num_segments(*sizes) == 1
    assert HEADS_OUTER.num_segments(*sizes) == 4


@pytest.mark.parametrize(
    ("layout", "segments"),
    [
        (get_layout("split"), 2),
        (get_layout("block_major"), 1),
        (HEADS_OUTER, 4),
        (hybrid_layout(HEADS_OUTER), 1),
    ],
)
def test_buffers_commit_one_block_per_segment(layout: AttentionLayout, segments: int) -> None:
    config = make_kv_cache_config([KVCacheGroup(["attn"], ATTN)], NUM_BLOCKS)
    cache = KVCache(config, {"attn": layout}, "cpu", extensible=True)
    assert cache.committed_bytes == segments * granule("cpu")
    assert cache.reserved_bytes == NUM_BLOCKS * ATTN.page_size_bytes
    cache.free()


def test_get_layout_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"kv_layout must be one of .*'split'"):
        get_layout("flash")


def test_layout_views_and_kv_views() -> None:
    """Each layout's k/v views pick the right slices of its logical shape."""
    n, b, h, d = 3, 4, 2, 8
    buffer = torch.arange(2 * n * b * h * d, dtype=torch.float32).view(torch.uint8)
    for name, k_of, v_of in [
        ("split", lambda x: x[0], lambda x: x[1]),
        ("block_major", lambda x: x[:, 0], lambda x: x[:, 1]),
    ]:
        view = get_layout(name).view(buffer, torch.float32, n, b, h, d)
        assert view.is_contiguous()
        k, v = get_layout(name).kv_views(view)
        assert k.shape == v.shape == (n, b, h, d)
        assert torch.equal(k, k_of(view)) and torch.equal(v, v_of(view))
    latent = get_layout("mla").view(buffer[: n * b * d * 4], torch.float32, n, b, 1, d)
    k, v = get_layout("mla").kv_views(latent)
    assert k.shape == (n, b, 1, d) and k.data_ptr() == v.data_ptr() == latent.data_ptr()


def test_stride_order_makes_kv_first_block_major() -> None:
    layout = hybrid_layout(get_layout("split"))
    n, b, h, d = 5, 16, 2, 64
    view = layout.view(
        torch.zeros(2 * n * b * h * d * 2, dtype=torch.uint8), torch.float16, n, b, h, d
    )
    assert view.shape == (2, n, b, h, d)
    assert view.stride() == (b * h * d, 2 * b * h * d, h * d, d, 1)
    assert hybrid_layout(get_layout("block_major")).physical_order == (0, 1, 2, 3, 4)


def test_packed_multi_layer_layout_is_rejected() -> None:
    with pytest.raises(ValueError, match="multi-layer"):
        AttentionLayout("packed", ("layers", "kv", "blocks", "block_size", "heads", "head"))
    with pytest.raises(ValueError, match="stride_order"):
        AttentionLayout("bad", ("blocks", "block_size", "head"), stride_order=(0, 1, 1))


# --- config ----------------------------------------------------------------------------


def test_config_one_group_has_one_tensor_per_layer() -> None:
    groups = [KVCacheGroup(["a", "b", "c"], ATTN)]
    config = make_kv_cache_config(groups, 10)
    assert [t.shared_by for t in config.tensors] == [["a"], ["b"], ["c"]]
    assert [t.size for t in config.tensors] == [10 * 8192] * 3
    assert bytes_per_block(groups) == 3 * 8192


def test_config_groups_share_tensors_by_position() -> None:
    """Local and global layers (one page size): buffer j holds the j-th layer of each group."""
    window = SlidingWindowSpec(16, 2, 64, torch.float16, sliding_window=64)
    specs = {"local.0": window, "global.0": ATTN, "local.1": window, "local.2": window}
    groups = group_layers(specs)
    assert [(g.kind, g.layer_names) for g in groups] == [
        ("sliding_window", ["local.0"]),
        ("sliding_window", ["local.1"]),
        ("sliding_window", ["local.2"]),
        ("full_attention", ["global.0"]),
    ]
    config = make_kv_cache_config(groups, 10)
    assert [t.shared_by for t in config.tensors] == [["local.0", "local.1", "local.2", "global.0"]]
    assert bytes_per_block(groups) == 8192
    narrow = SlidingWindowSpec(16, 1, 64, torch.float16, sliding_window=64)  # 4096-byte pages
    with pytest.raises(ValueError, match=r"one page size, got \[4096, 8192\]"):
        make_kv_cache_config([KVCacheGroup(["a"], ATTN), KVCacheGroup(["c"], narrow)], 10)


def test_config_hybrid_shares_buffers_across_kinds() -> None:
    specs = {"attn.0": ATTN, "attn.1": ATTN} | {f"mamba.{i}": MAMBA for i in range(5)}
    groups = group_layers(specs)
    config = make_kv_cache_config(groups, 7)
    assert [t.shared_by for t in config.tensors] == [
        ["attn.0", "mamba.0", "mamba.2", "mamba.4"],
        ["attn.1", "mamba.1", "mamba.3"],
    ]
    assert [g.layer_names for g in config.groups] == [
        ["attn.0", "attn.1"],
        ["mamba.0", "mamba.1"],
        ["mamba.2", "mamba.3"],
        ["mamba.4"],
    ]
    assert all(g.spec.page_size_bytes == ATTN.page_size_bytes for g in config.groups)
    assert all(t.size == 7 * ATTN.page_size_bytes for t in config.tensors)
    assert bytes_per_block(groups) == 2 * ATTN.page_size_bytes


def test_config_hybrid_rejects_mamba_page_larger_than_attention_page() -> None:
    small = FullAttentionSpec(1, 2, 64, torch.float16)  # 512-byte pages < 2560 of MAMBA
    with pytest.raises(ValueError, match="block_size must be >= 5"):
        group_layers({"a": small, "m": MAMBA})


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: make_kv_cache_config([KVCacheGroup(["a"], ATTN)], 0), "num_blocks"),
        (lambda: make_kv_cache_config([], 4), "groups"),
        (lambda: KVCacheConfig(4, [KVCacheTensor(4 * 8192, ["a"])], []), "shared_by"),
        (
            lambda: KVCacheConfig(4, [KVCacheTensor(8192, ["a"])], [KVCacheGroup(["a"], ATTN)]),
            "num_blocks",
        ),
        (
            lambda: KVCacheConfig(1, [KVCacheTensor(8192, ["a"])], [KVCacheGroup(["a"], ATTN)] * 2),
            "more than one group",
        ),
    ],
)
def test_bad_configs(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


# --- allocation and extension ----------------------------------------------------------


def dirty_committed_tail(cache: KVCache, layer: str, layout: str, device: str) -> None:
    """Fresh pages read as zero anyway; scribble on the blocks that share block 0's granule
    (committed, not yet part of the cache) so that `extend` failing to zero them shows."""
    segments = get_layout(layout).num_segments(NUM_BLOCKS, 16, 2, 64)
    blocks_in_granule = granule(device) // (ATTN.page_size_bytes // segments)
    for half in cache.kv_views(layer):
        half[1:blocks_in_granule] = 7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layout", "segments"), [("split", 2), ("block_major", 1)])
def test_extensible_attention(layout: str, segments: int, device: str) -> None:
    cache = attention_cache(layout, device, extensible=True)
    assert (cache.num_blocks, cache.capacity_blocks) == (1, NUM_BLOCKS)
    assert cache.committed_bytes == 2 * segments * granule(device)  # block 0 of every segment
    views = {name: cache.layer_views[name].data_ptr() for name in cache.layer_views}
    k, v = cache.kv_views("attn.0")
    assert k.shape == v.shape == (NUM_BLOCKS, 16, 2, 64)
    first = [fill_(k[0]), fill_(v[0])]
    dirty_committed_tail(cache, "attn.0", layout, device)

    assert cache.extend(NUM_BLOCKS) == NUM_BLOCKS == cache.num_blocks
    assert cache.committed_bytes == cache.reserved_bytes == 2 * NUM_BLOCKS * ATTN.page_size_bytes
    assert {name: cache.layer_views[name].data_ptr() for name in cache.layer_views} == views
    assert torch.equal(k[0], first[0]) and torch.equal(v[0], first[1])
    fill_(k[-1])
    fill_(v[-1])
    assert is_zero(k[1:-1]) and is_zero(v[1:-1])
    for half in cache.kv_views("attn.1"):
        fill_(half[-1])
        assert is_zero(half[:-1])
    cache.free()


@pytest.mark.parametrize("device", DEVICES)
def test_extend_keeps_data_and_is_a_no_op_for_committed_counts(device: str) -> None:
    cache = attention_cache("split", device, extensible=True)
    assert cache.extend(100) == 100
    k, v = cache.kv_views("attn.0")
    before = [fill_(k[:100]), fill_(v[:100])]
    committed = cache.committed_bytes
    assert cache.extend(100) == cache.extend(50) == 100
    assert cache.committed_bytes == committed
    assert cache.extend(1500) == 1500
    assert torch.equal(k[:100], before[0]) and torch.equal(v[:100], before[1])
    assert is_zero(k[100:1500]) and is_zero(v[100:1500])
    with pytest.raises(ValueError, match="capacity"):
        cache.extend(NUM_BLOCKS + 1)
    with pytest.raises(ValueError, match="num_blocks"):
        cache.extend(0)
    cache.free()
    cache.free()
    assert cache.committed_bytes == 0 and cache.layer_views == {}


@pytest.mark.parametrize("device", DEVICES)
def test_legacy(device: str) -> None:
    cache = attention_cache("split", device, extensible=False)
    assert cache.num_blocks == cache.capacity_blocks == NUM_BLOCKS
    assert cache.committed_bytes == cache.reserved_bytes == 2 * NUM_BLOCKS * ATTN.page_size_bytes
    assert cache.bytes_by_kind() == {"attention": cache.committed_bytes}
    k, v = cache.kv_views("attn.1")
    assert is_zero(k) and is_zero(v)
    fill_(k[-1])
    fill_(v[-1])
    with pytest.raises(RuntimeError, match="extensible"):
        cache.extend(NUM_BLOCKS)


@pytest.mark.parametrize("device", DEVICES)
def test_mamba(device: str) -> None:
    layers = ["mamba.0", "mamba.1"]
    config = make_kv_cache_config([KVCacheGroup(layers, MAMBA)], NUM_BLOCKS)
    cache = KVCache(config, {}, device, extensible=True)
    assert cache.committed_bytes == 2 * granule(device)
    states = [state for name in layers for state in cache.layer_views[name]]
    assert [s.shape for s in states] == [(NUM_BLOCKS, 32, 4), (NUM_BLOCKS, 4, 8, 32)] * 2
    assert [s.dtype for s in states] == [torch.float32, torch.bfloat16] * 2
    first = [fill_(s[0]) for s in states]
    for s in states:  # the rest of block 0's granule: committed, must be zeroed by extend
        s[1 : granule(device) // MAMBA.page_size_bytes] = 7

    assert cache.extend(NUM_BLOCKS) == NUM_BLOCKS
    for state, block0 in zip(states, first, strict=True):
        assert torch.equal(state[0], block0)
        fill_(state[-1])
    for state in states:
        assert is_zero(state[1:-1])
    assert cache.bytes_by_kind() == {"mamba": cache.committed_bytes}
    assert cache.committed_bytes >= 2 * NUM_BLOCKS * MAMBA.page_size_bytes
    with pytest.raises(ValueError, match="attention layer"):
        cache.kv_views("mamba.0")
    cache.free()


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid(device: str) -> None:
    groups = group_layers({"attn.0": ATTN, "mamba.0": MAMBA, "mamba.1": MAMBA})
    config = make_kv_cache_config(groups, NUM_BLOCKS)
    assert [t.shared_by for t in config.tensors] == [["attn.0", "mamba.0", "mamba.1"]]
    with pytest.raises(ValueError, match="agree on segments"):
        KVCache(config, {"attn.0": get_layout("split")}, device, extensible=True)

    cache = KVCache(config, {"attn.0": hybrid_layout(get_layout("split"))}, device, True)
    b, h, d = 16, 2, 64
    view = cache.layer_views["attn.0"]
    assert view.shape == (2, NUM_BLOCKS, b, h, d)
    assert view.stride() == (b * h * d, 2 * b * h * d, h * d, d, 1)
    assert cache.committed_bytes == granule(device)  # one segment
    assert cache.bytes_by_kind() == {"attention+mamba": granule(device)}

    # A block belongs to one group at a time: attention 0, mamba.0 1, mamba.1 2.
    cache.extend(3)
    k, v = cache.kv_views("attn.0")
    kv0 = [fill_(k[0]), fill_(v[0])]
    assert all(is_zero(s[1:3]) for name in ("mamba.0", "mamba.1") for s in cache.layer_views[name])
    m0 = [fill_(s[1]) for s in cache.layer_views["mamba.0"]]
    m1 = [fill_(s[2]) for s in cache.layer_views["mamba.1"]]
    assert cache.extend(NUM_BLOCKS) == NUM_BLOCKS
    assert torch.equal(k[0], kv0[0]) and torch.equal(v[0], kv0[1])
    for states, block, saved in [("mamba.0", 1, m0), ("mamba.1", 2, m1)]:
        for state, expected in zip(cache.layer_views[states], saved, strict=True):
            assert torch.equal(state[block], expected)
            fill_(state[-1])
    assert is_zero(k[3:-1]) and is_zero(v[3:-1])
    fill_(k[-1])
    fill_(v[-1])
    cache.free()


# --- shrinking and moving blocks (elastic resizing) ---------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layout", "segments"), [("split", 2), ("block_major", 1)])
def test_shrink_gives_the_tail_back_and_extend_grows_it_again(
    layout: str, segments: int, device: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = attention_cache(layout, device, extensible=True)
    views = {name: cache.layer_views[name].data_ptr() for name in cache.layer_views}
    cache.extend(1500)
    k, v = cache.kv_views("attn.0")
    kept = [fill_(k[:100]), fill_(v[:100])]
    with caplog.at_level(logging.INFO, logger="extkv.kv_cache"):
        assert cache.shrink(100) == cache.num_blocks == 100
    # 100 blocks fit one granule of every segment of both layers.
    assert cache.committed_bytes == 2 * segments * granule(device)
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("Shrank KV cache to 100 blocks. ") and "GiB committed (-" in message
    assert torch.equal(k[:100], kept[0]) and torch.equal(v[:100], kept[1])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="extkv.kv_cache"):
        assert cache.extend(600) == 600
    assert caplog.records[0].getMessage().startswith("Extended KV cache to 600 blocks. ")
    assert torch.equal(k[:100], kept[0]) and torch.equal(v[:100], kept[1])
    assert is_zero(k[100:600]) and is_zero(v[100:600])
    assert {name: cache.layer_views[name].data_ptr() for name in cache.layer_views} == views
    assert cache.shrink(0) == 0 and cache.committed_bytes == 0
    assert cache.extend(1) == 1
    fill_(k[0])
    cache.free()


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_moves_every_layer_of_a_block(device: str) -> None:
    """Attention K and V and Mamba states alike: a block is its bytes in every buffer."""
    groups = group_layers({"attn.0": ATTN, "mamba.0": MAMBA})
    config = make_kv_cache_config(groups, NUM_BLOCKS)
    cache = KVCache(config, {"attn.0": hybrid_layout(get_layout("split"))}, device, True)
    cache.extend(8)
    k, v = cache.kv_views("attn.0")
    attention = [fill_(k[5]), fill_(v[5])]
    states = [fill_(s[6]) for s in cache.layer_views["mamba.0"]]
    untouched = [fill_(k[3]), fill_(v[3])]
    cache.copy_blocks({5: 1, 6: 2})
    assert torch.equal(k[1], attention[0]) and torch.equal(v[1], attention[1])
    for state, saved in zip(cache.layer_views["mamba.0"], states, strict=True):
        assert torch.equal(state[2], saved)
    assert torch.equal(k[3], untouched[0]) and torch.equal(v[3], untouched[1])
    with pytest.raises(ValueError, match=r"committed blocks, in \[0, 8\); got \[8\]"):
        cache.copy_blocks({8: 0})
    cache.free()


def test_blocks_within_counts_whole_granules_and_shrink_errors() -> None:
    cache = attention_cache("split", "cpu", extensible=True)
    g = granule("cpu")
    # Two layers' K and V: four segments of 4 KiB per block, 512 blocks per granule.
    assert cache.blocks_within(4 * g - 1) == 0
    assert cache.blocks_within(4 * g) == 512
    assert cache.blocks_within(10 * g) == 1024  # 2.5 granules a segment: 2 whole ones
    assert cache.blocks_within(1 << 40) == NUM_BLOCKS
    cache.extend(1024)
    assert cache.committed_bytes == 8 * g
    with pytest.raises(ValueError, match="use extend"):
        cache.shrink(1025)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0"):
        cache.shrink(-1)
    assert cache.num_blocks == 1024  # failed calls changed nothing
    cache.free()
    legacy = attention_cache("split", "cpu", extensible=False)
    with pytest.raises(RuntimeError, match="shrink needs an extensible KV cache"):
        legacy.shrink(1)
    with pytest.raises(RuntimeError, match="extensible"):
        legacy.blocks_within(g)


def test_out_of_memory_commits_the_largest_count_that_fits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = HostBackend(commit_limit_bytes=21 * MiB)
    cache = attention_cache("split", "cpu", extensible=True, backend=backend)
    k, v = cache.kv_views("attn.0")
    first = [fill_(k[0]), fill_(v[0])]
    with caplog.at_level(logging.WARNING, logger="extkv.kv_cache"):
        reached = cache.extend(NUM_BLOCKS)
    # Two layers' K and V: four segments of 4 KiB per block, 512 blocks per granule. 21 MiB
    # holds 10 granules: two per segment (1024 blocks) fit, three do not.
    assert reached == cache.num_blocks == 1024
    assert "1024 blocks" in caplog.text and f"{NUM_BLOCKS} blocks" in caplog.text
    assert backend.committed_bytes == cache.committed_bytes <= 21 * MiB  # no scratch left over
    assert torch.equal(k[0], first[0]) and torch.equal(v[0], first[1])
    for name in ("attn.0", "attn.1"):
        for half in cache.kv_views(name):
            fill_(half[reached - 1])
    assert cache.extend(reached + 1) == reached  # truly the largest count
    cache.free()
    assert backend.committed_bytes == 0


def test_out_of_memory_after_the_probe_still_gives_a_count_every_buffer_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory taken by someone else between the probe and the commit."""
    backend = HostBackend(commit_limit_bytes=26 * MiB)
    cache = attention_cache("block_major", "cpu", extensible=True, backend=backend)
    monkeypatch.setattr(KVCache, "_fits", lambda self, n: True)
    reached = cache.extend(NUM_BLOCKS)
    # The first layer takes all 8 granules, leaving the second 13 - 9 = 4 more: 5 * 256 blocks.
    assert reached == cache.num_blocks == 1280
    for name in ("attn.0", "attn.1"):
        for half in cache.kv_views(name):
            fill_(half[:reached])
    cache.free()
    assert backend.committed_bytes == 0


def test_failed_construction_leaks_nothing() -> None:
    backend = HostBackend(commit_limit_bytes=5 * MiB)  # the first layer's 2 granules fit, not 4
    with pytest.raises(MemoryError):
        attention_cache("split", "cpu", extensible=True, backend=backend)
    assert backend.committed_bytes == 0


def test_layout_errors() -> None:
    config = make_kv_cache_config([KVCacheGroup(["attn"], ATTN)], 4)
    with pytest.raises(ValueError, match="layouts"):
        KVCache(config, {}, "cpu", extensible=True)
    with pytest.raises(ValueError, match="'mla'"):
        KVCache(config, {"attn": get_layout("mla")}, "cpu", extensible=True)
    shared = KVCacheConfig(
        4, [KVCacheTensor(4 * 8192, ["a", "b"])], [KVCacheGroup(["a", "b"], ATTN)]
    )
    layouts = {"a": get_layout("split"), "b": get_layout("block_major")}
    with pytest.raises(ValueError, match=r"agree on segments.*'a': 2, 'b': 1"):
        KVCache(shared, layouts, "cpu", extensible=True)


# --- property --------------------------------------------------------------------------


@st.composite
def attention_layers(draw: st.DrawFn) -> tuple[AttentionLayout, FullAttentionSpec | MLASpec]:
    mla = draw(st.booleans())
    dims = (
        ("blocks", "block_size", "head") if mla else ("kv", "blocks", "block_size", "heads", "head")
    )
    dims = tuple(draw(st.permutations(dims)))
    order = draw(st.none() | st.permutations(range(len(dims))).map(tuple))
    block_size = draw(st.sampled_from([1, 4, 16]))
    head_size = draw(st.sampled_from([8, 32, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.float32]))
    if mla:
        spec = MLASpec(block_size, head_size, dtype)
    else:
        spec = FullAttentionSpec(block_size, draw(st.integers(1, 3)), head_size, dtype)
    return AttentionLayout("random", dims, order), spec


def random_setup(layers, data: st.DataObject) -> tuple[KVCacheConfig, dict[str, AttentionLayout]]:
    """One layer per drawn layout, each over 3 to 5 granules, so segments rarely align to them."""
    g = granule("cpu")
    largest = max(spec.page_size_bytes for _, spec in layers)
    capacity = data.draw(st.integers(math.ceil(3 * g / largest), math.ceil(5 * g / largest)))
    names = [f"layer.{i}" for i in range(len(layers))]
    groups = [KVCacheGroup([name], spec) for name, (_, spec) in zip(names, layers, strict=True)]
    layouts = {name: layout for name, (layout, _) in zip(names, layers, strict=True)}
    tensors = [KVCacheTensor(capacity * g.spec.page_size_bytes, g.layer_names) for g in groups]
    return KVCacheConfig(capacity, tensors, groups), layouts


def distinct_halves(cache: KVCache) -> list[torch.Tensor]:
    halves = []
    for name in cache.layer_views:
        k, v = cache.kv_views(name)
        halves += [k] if k.data_ptr() == v.data_ptr() else [k, v]  # MLA: K is V
    return halves


@settings(max_examples=25, deadline=None)
@given(layers=st.lists(attention_layers(), min_size=1, max_size=2), data=st.data())
def test_every_block_writable_and_old_blocks_kept(layers, data: st.DataObject) -> None:
    cache = KVCache(*random_setup(layers, data), "cpu", extensible=True)
    halves = distinct_halves(cache)
    kept = [fill_(half[:1]) for half in halves]
    for target in (data.draw(st.integers(1, cache.capacity_blocks)), cache.capacity_blocks):
        old = cache.num_blocks
        assert cache.extend(target) == max(target, old)
        for half, before in zip(halves, kept, strict=True):
            assert torch.equal(half[:old], before)
            assert is_zero(half[old : cache.num_blocks])
        kept = [fill_(half[: cache.num_blocks]) for half in halves]
    cache.free()


@settings(max_examples=15, deadline=None)
@given(layers=st.lists(attention_layers(), min_size=1, max_size=2), data=st.data())
def test_out_of_memory_extend_is_maximal_and_leaks_nothing(layers, data: st.DataObject) -> None:
    backend = HostBackend()
    config, layouts = random_setup(layers, data)
    cache = KVCache(config, layouts, "cpu", extensible=True, backend=backend)
    limit = data.draw(st.integers(cache.committed_bytes, 12 * granule("cpu")))
    backend.commit_limit_bytes = limit
    reached = cache.extend(cache.capacity_blocks)
    assert backend.committed_bytes == cache.committed_bytes <= limit
    for half in distinct_halves(cache):
        fill_(half[:reached])
    if reached < cache.capacity_blocks:  # one more block must not fit, as an unlimited twin shows
        backend.commit_limit_bytes = None
        twin = KVCache(config, layouts, "cpu", extensible=True)
        twin.extend(reached + 1)
        assert twin.committed_bytes > limit
        twin.free()
    cache.free()
    assert backend.committed_bytes == 0
