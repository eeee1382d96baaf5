"""The CPU's attention (the torch reference): exact, and memory linear in the prompt.

A whole prompt is one causal SDPA call, as transformers makes it; a prompt after a cached
prefix is two flash calls (prefix, causal new part) merged on the CPU, and goes a chunk of
queries at a time elsewhere (the GPU kernels' oracle, run here on the CPU too). None may
build the prompt x context scores."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from extkv.attention.reference import (
    causal_attention,
    masked_chunk_attention,
    varlen_attention_reference,
)
from extkv.engine.host_memory import peak_resident_bytes, reset_peak_resident, resident_bytes

SCALE = 0.125
MiB = 1 << 20


def qkv(q_len: int, kv_len: int, heads: int = 6, kv_heads: int = 2, dim: int = 32):
    gen = torch.Generator().manual_seed(q_len * 7919 + kv_len)
    q = torch.randn(q_len, heads, dim, generator=gen)
    k, v = torch.randn(2, kv_len, kv_heads, dim, generator=gen)
    return q, k, v


def full_mask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    images: list[tuple[int, int]] = (),
) -> torch.Tensor:
    """The definition, in float64: every score of the prompt against its context at once
    (with a window W, a query sees its last W positions, as transformers' mask). The
    tokens of each of `images` ((first position, length)) also see each other, as
    transformers' Gemma 3 mask: (causal or same image) and window."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    q_len, kv_len = q.shape[1], k.shape[1]
    pos = torch.arange(kv_len)
    image = torch.full((kv_len,), -1)
    for index, (first, length) in enumerate(images):
        image[first : first + length] = index
    query_pos = pos[kv_len - q_len :, None]
    same_image = (image[kv_len - q_len :, None] == image[None, :]) & (image[None, :] >= 0)
    seen = (pos[None, :] <= query_pos) | same_image
    hidden = ~seen | (pos[None, :] <= query_pos - (window or kv_len))
    scores = (q @ k.transpose(1, 2) * SCALE).masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize(
    ("q_len", "kv_len", "chunk"),
    [
        (1500, 1500, 64),  # a whole prompt
        (700, 1000, 64),  # after a cached prefix of 300: 11 chunks, the last one short
        (130, 131, 7),
        (256, 512, 256),  # one chunk exactly
        (1, 900, 64),  # a decode
    ],
)
def test_attention_equals_the_full_mask(q_len: int, kv_len: int, chunk: int) -> None:
    q, k, v = qkv(q_len, kv_len)
    expected = full_mask_attention(q, k, v)
    for out in (causal_attention(q, k, v, SCALE), masked_chunk_attention(q, k, v, SCALE, chunk)):
        assert out.shape == q.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)


def test_after_a_prefix_the_cpu_takes_two_unmasked_flash_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt after a cached prefix: the prefix part without a mask, the new part causal
    in the kernel (no mask built), not a masked call over the new tokens' square; neither
    copies the K/V heads per query head."""
    q, k, v = qkv(700, 1000)
    calls: list[tuple[tuple[int, ...], bool, bool]] = []
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def recording(query, key, value, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((tuple(key.shape), is_causal, kwargs.get("attn_mask") is not None))
        return flash(query, key, value, dropout_p, is_causal, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", recording)
    causal_attention(q, k, v, SCALE)
    assert calls == [((1, 2, 300, 32), False, False), ((1, 2, 700, 32), True, False)]


@pytest.mark.parametrize(
    ("q_len", "kv_len", "window"),
    [(300, 300, 37), (200, 450, 64), (1, 500, 100), (50, 60, 100)],  # the last: within it
)
def test_sliding_window_equals_its_full_mask(q_len: int, kv_len: int, window: int) -> None:
    q, k, v = qkv(q_len, kv_len)
    expected = full_mask_attention(q, k, v, window)
    for out in (
        causal_attention(q, k, v, SCALE, window),
        masked_chunk_attention(q, k, v, SCALE, 64, sliding_window=window),
    ):
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)


# A whole prompt; after a cached prefix of 20 (an image in it, one begun in it), with a
# window shorter than the images; one query, the last token of an image.
IMAGE_CASES = [(60, 60, None, 16), (50, 70, None, 64), (50, 70, 9, 16), (1, 29, None, 8)]
IMAGES = [(2, 6), (17, 12), (35, 20)]


@pytest.mark.parametrize(("q_len", "kv_len", "window", "chunk"), IMAGE_CASES)
def test_image_blocks_equal_their_full_mask(
    q_len: int, kv_len: int, window: int | None, chunk: int
) -> None:
    """Key bounds at each image's last token give transformers' Gemma 3 mask: images in
    the cached prefix, begun in it, across query chunks, longer than the window."""
    q, k, v = qkv(q_len, kv_len)
    images = [(first, length) for first, length in IMAGES if first + length <= kv_len]
    bounds = torch.arange(kv_len - q_len, kv_len)
    for first, length in images:
        inside = (bounds >= first) & (bounds < first + length)
        bounds = torch.where(inside, first + length - 1, bounds)
    expected = full_mask_attention(q, k, v, window, images)
    out = masked_chunk_attention(q, k, v, SCALE, chunk, sliding_window=window, key_bounds=bounds)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    if q_len > 1:  # the images matter
        assert not torch.allclose(out.double(), full_mask_attention(q, k, v, window), atol=1e-3)


def test_a_whole_prompt_is_transformers_call() -> None:
    """Bit for bit what transformers' SDPA attention computes (causal, no mask, GQA)."""
    q, k, v = qkv(900, 900)
    expected = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=SCALE, enable_gqa=True
    )
    assert torch.equal(causal_attention(q, k, v, SCALE), expected[0].transpose(0, 1))


def test_packed_prompts_of_equal_lengths_go_together() -> None:
    """The profiling run's packed batch, sequences of one length in one batched call: every
    sequence equals its own full-mask attention."""
    lengths = [8, 8, 5, 8, 0, 5, 1, 8]
    q, k, v = qkv(sum(lengths), sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = varlen_attention_reference(q, k, v, cu, SCALE)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        expected = full_mask_attention(q[start:end], k[start:end], v[start:end])
        torch.testing.assert_close(out[start:end].double(), expected, atol=2e-6, rtol=0)


def test_chunks_bound_every_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU, after a cached prefix, no SDPA call sees more than `chunk` queries: its
    mask (and scores) are at most chunk x context, never prompt x context."""
    q, k, v = qkv(1000, 1600)
    calls: list[tuple[int, int]] = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[-2], 0 if attn_mask is None else attn_mask.numel()))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    masked_chunk_attention(q, k, v, SCALE, chunk=128)
    assert len(calls) == 8  # ceil(1000 / 128)
    assert max(queries for queries, _ in calls) == 128
    assert max(mask for _, mask in calls) <= 128 * 1600


@pytest.mark.parametrize(("q_len", "kv_len"), [(8192, 8192), (4096, 8192)])
def test_prefill_memory_is_linear(q_len: int, kv_len: int) -> None:
    """One head of an 8192-token context: the whole scores would take 256 MiB (and their
    mask 64 MiB more); the attention takes a few MiB beyond its inputs."""
    if not reset_peak_resident():
        pytest.skip("this OS cannot reset the resident set's high-water mark")
    q, k, v = qkv(q_len, kv_len, heads=1, kv_heads=1, dim=16)
    for attention in (causal_attention, partial(masked_chunk_attention, chunk=256)):
        attention(q[:8], k[: kv_len - q_len + 8], v[: kv_len - q_len + 8], SCALE)
        reset_peak_resident()
        before = resident_bytes()
        attention(q, k, v, SCALE)
        assert peak_resident_bytes() - before < 48 * MiB, attention


def test_chunk_must_be_positive() -> None:
    q, k, v = qkv(4, 8)
    with pytest.raises(ValueError, match="chunk must be a positive number of queries; got 0"):
        masked_chunk_attention(q, k, v, SCALE, chunk=0)


@pytest.mark.parametrize("window", [None, 5])
def test_a_decode_batch_attends_together(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """One query per sequence, contexts of 1 to 40 tokens on scattered blocks of 4 (every
    other block NaN, as memory no sequence holds may be): the same as each sequence on
    its own, whether the batch goes in one call or in several (a small gather budget)."""
    from extkv.attention import reference
    from extkv.attention.metadata import AttentionMetadata

    lengths = [1, 40, 7, 16, 23]
    block_size, heads, kv_heads, dim = 4, 6, 2, 32
    widths = [-(-n // block_size) for n in lengths]
    cache = torch.full((2, 2 * sum(widths) + 2, block_size, kv_heads, dim), float("nan"))
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    for s, width in enumerate(widths):
        blocks = torch.arange(width) * 2 + 2 * sum(widths[:s]) + 1  # odd blocks: theirs
        tables[s, :width] = blocks
        cache[:, blocks] = torch.randn(2, width, block_size, kv_heads, dim, generator=gen)
    metadata = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.zeros(len(lengths), dtype=torch.int64),
        cu_seqlens_q=torch.arange(len(lengths) + 1, dtype=torch.int32),
        context_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=tables,
        max_seqlen_q=1,
        max_context_len=max(lengths),
    )
    query = torch.randn(len(lengths), heads, dim, generator=gen)
    expected = torch.cat(
        [
            causal_attention(
                query[s : s + 1],
                reference.gather_context(cache[0], tables[s], n),
                reference.gather_context(cache[1], tables[s], n),
                SCALE,
                window,
            )
            for s, n in enumerate(lengths)
        ]
    )
    together = reference.paged_attention_reference(
        query, cache[0], cache[1], metadata, SCALE, window
    )
    torch.testing.assert_close(together, expected, atol=1e-6, rtol=0)
    monkeypatch.setattr(reference, "DECODE_GATHER_BYTES", 2 * 40 * kv_heads * dim * 4)
    in_pairs = reference.paged_attention_reference(
        query, cache[0], cache[1], metadata, SCALE, window
    )
    torch.testing.assert_close(in_pairs, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_cpu_prefill_reads_back_only_cached_prefixes(
    monkeypatch: pytest.MonkeyPatch, qk_norm: bool
) -> None:
    """The CPU step (q/k prepared, K/V stored, attention) gives the new tokens' K/V to the
    attention as computed: a whole prompt reads nothing back from the cache, a chunk after a
    cached prefix only that prefix; the output and the cache are those of the kernels'
    oracle (store, then attend over what the cache holds)."""
    from extkv.attention import ops, reference
    from extkv.attention.metadata import AttentionMetadata
    from extkv.models import reference as model_reference

    heads, kv_heads, dim, block_size = 6, 2, 32, 4
    new, context = [5, 6], [5, 13]  # a whole prompt; 6 tokens after a prefix of 7
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(new), (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12])
    cos_sin = torch.randn(16, dim, generator=gen)
    norms = (torch.randn(dim, generator=gen), torch.randn(dim, generator=gen), 1e-6)
    prepare = (qkv, positions, cos_sin, heads, kv_heads, *(norms if qk_norm else (None, None, 0)))
    tables = torch.tensor([[5, 1, -1, -1], [0, 3, 2, 6]], dtype=torch.int32)
    slot_mapping = torch.tensor([20, 21, 22, 23, 4, 15, 8, 9, 10, 11, 24])  # through tables
    metadata = AttentionMetadata(
        is_prefill=True,
        slot_mapping=slot_mapping,
        cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32),
        context_lens=torch.tensor(context, dtype=torch.int32),
        block_tables=tables,
        max_seqlen_q=max(new),
        max_context_len=max(context),
    )
    cache = torch.randn(2, 7, block_size, kv_heads, dim, generator=gen)
    expected_cache = cache.clone()
    q = model_reference.qk_norm_rope_store(*prepare, *expected_cache, slot_mapping)
    expected = reference.paged_attention_reference(q, *expected_cache, metadata, SCALE)

    read_back: list[int] = []
    gather = reference.gather_context

    def recording(cache, block_table, context_len, first_block=0):
        read_back.append(context_len)
        return gather(cache, block_table, context_len, first_block)

    monkeypatch.setattr(reference, "gather_context", recording)
    out = ops.rope_store_attention(*prepare, *cache, metadata, SCALE)
    assert read_back == [0, 0, 7, 7]  # K and V of each sequence: its cached prefix only
    assert torch.equal(cache, expected_cache)
    assert torch.equal(out, expected)
