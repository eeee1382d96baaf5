"""A step's model inputs: built once from the plan, staged into persistent device buffers.

`build_step_inputs` turns a `StepPlan` into a few small host arrays (the driver
sends them to every tensor-parallel rank). `InputBuffers` is the one place
they go on the device: a pinned host buffer and its device twin, filled by one
copy per step. Eager steps and CUDA-graph replays read the same buffers; a
graph of batch size `bs` was captured against the views of a `bs`-row step
(`StepShape.decode(bs, ...)`), so staging a decode step padded to `bs` rows is
all a replay needs.

KV cache groups (extkv.kv_cache.groups) each have their own part: every attention
group a row of cache slots and a block table, every recurrent group a row of state
blocks, all in the one buffer; a captured graph therefore reads each group's table at
an address of its own that never moves.

The layout of the buffer depends only on the step's shape, and a step's arrays
are packed at its start, so the copy moves no byte more than the step uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from extkv.attention import AttentionMetadata, ForwardContext, MambaMetadata
from extkv.engine.step_plan import StepPlan
from extkv.kv_cache.plan import KVCachePlan

TOKEN_ROWS = 3  # input ids, positions, token sources; then a row of slots per attention group


@dataclass(frozen=True)
class StepShape:
    """How many tokens, sequences and block-table columns a staged step spans."""

    num_tokens: int
    num_seqs: int
    width: int

    @classmethod
    def decode(cls, batch_size: int, width: int) -> StepShape:
        """The shape of a decode of `batch_size` rows: one token per sequence."""
        return cls(batch_size, batch_size, width)


@dataclass
class StepInputs:
    """One step's inputs as host int32 arrays, before any padding.

    `tokens` rows: input id, position, token source (>= 0: the input token is still on
    the device, row `source` of the tokens the previous step sampled), then the cache
    slot (-1: no write) in each attention group. `seqs` rows: context length, whether
    the sequence continues an earlier step (its recurrent state is carried), then its
    state block in each recurrent group. `block_tables` has one table per attention
    group. `cu_seqlens` has num_seqs + 1 entries.

    Images (prefill only): the encoder cache drops the entries `evicted_encoder_hashes`,
    then encodes `encoder_inputs` ((hash, pixels) each); `image_rows` says which token
    rows take which embeddings: (hash, first embedding, first row, count). Where an
    image's tokens see each other (Gemma 3), `key_bounds` has each token's last visible
    key position (its own, or its image's last; see AttentionMetadata)."""

    is_prefill: bool
    tokens: np.ndarray  # (3 + num_attention_groups, num_tokens)
    cu_seqlens: np.ndarray  # (num_seqs + 1,)
    seqs: np.ndarray  # (2 + num_state_groups, num_seqs)
    block_tables: np.ndarray  # (num_attention_groups, num_seqs, width), 0-padded
    sample_rows: np.ndarray  # token rows whose logits are sampled
    prompt_rows: np.ndarray  # token rows whose logits give prompt logprobs (often none)
    encoder_inputs: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    evicted_encoder_hashes: list[str] = field(default_factory=list)
    image_rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    key_bounds: np.ndarray | None = None  # int32 (num_tokens,)

    @property
    def no_cached_prefix(self) -> bool:
        """A prefill whose sequences all start at their first token (nothing cached)."""
        return self.is_prefill and not self.seqs[1].any()

    @property
    def num_tokens(self) -> int:
        """Tokens in the step, before padding."""
        return self.tokens.shape[1]

    @property
    def num_seqs(self) -> int:
        """Sequences in the step, before padding."""
        return self.seqs.shape[1]

    @property
    def width(self) -> int:
        """Block-table columns the step uses."""
        return self.block_tables.shape[2]


def build_step_inputs(
    plan: StepPlan, kv_plan: KVCachePlan, last_rows: dict[str, int], whole_images: bool = False
) -> StepInputs:
    """The host arrays of `plan`; `last_rows` says where each request's pending token is
    among the tokens the previous step sampled; `whole_images`: an image's tokens see
    each other (key bounds). It runs every step for every request, so the per-request
    work is kept to one pass of builtins each; the rest is numpy."""
    requests = plan.requests
    num_seqs = len(requests)
    starts = np.fromiter((r.num_computed_tokens for r in requests), np.int64, num_seqs)
    if plan.is_prefill:
        counts = np.fromiter((r.num_new_tokens for r in requests), np.int64, num_seqs)
        cu_seqlens = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=cu_seqlens[1:])
        seq_of_token = np.repeat(np.arange(num_seqs), counts)
        positions = np.arange(cu_seqlens[-1]) + np.repeat(starts - cu_seqlens[:-1], counts)
        sampled = np.fromiter((r.sampling is not None for r in requests), bool, num_seqs)
        sample_rows = cu_seqlens[1:][sampled] - 1
    else:  # one token per sequence, each sampled (see StepPlan.sampled)
        counts = np.ones(num_seqs, dtype=np.int64)
        cu_seqlens = np.arange(num_seqs + 1)
        seq_of_token, positions = cu_seqlens[:-1], starts
        sample_rows = seq_of_token
    num_tokens = int(cu_seqlens[-1])
    num_attention = len(kv_plan.attention_groups)
    # The arrays handed on are int32 from the start: assigning casts as astype would.
    tokens = np.empty((TOKEN_ROWS + num_attention, num_tokens), dtype=np.int32)
    tokens[1] = positions
    # A pending token is its request's last one: id 0 there, its source row set; the
    # known ids fill the other rows (in a decode with async scheduling, often none).
    pending = np.fromiter((r.pending for r in requests), bool, num_seqs)
    pending_rows = cu_seqlens[1:][pending] - 1
    tokens[0] = 0
    tokens[2] = -1
    is_known = np.ones(num_tokens, dtype=bool)
    is_known[pending_rows] = False
    known = chain.from_iterable(r.token_ids for r in requests)
    tokens[0, is_known] = np.fromiter(known, np.int64, num_tokens - len(pending_rows))
    sources = (last_rows[r.request_id] for r in requests if r.pending)
    tokens[2, pending_rows] = np.fromiter(sources, np.int64, len(pending_rows))
    # Attention groups come first among the tables, their tables all of one length.
    rows = np.fromiter((r.table_row for r in requests), np.int64, num_seqs)
    if num_seqs and rows.min() < 0:  # -1 would read the last row: another sequence's blocks
        raise RuntimeError("a step's request holds no block tables (table_row -1)")
    if num_attention and num_seqs:
        tables = plan.block_tables.gather(slice(0, num_attention), rows)
        size = kv_plan.block_size
        tokens[TOKEN_ROWS:] = tables[:, seq_of_token, positions // size] * size + positions % size
    else:
        tables = np.zeros((num_attention, num_seqs, 0), dtype=np.int32)
    num_state = len(kv_plan.state_groups)
    seqs = np.empty((2 + num_state, num_seqs), dtype=np.int32)
    seqs[0] = starts + counts
    seqs[1] = starts > 0
    if num_state and num_seqs:  # a recurrent group's table is its one state block
        seqs[2:] = plan.block_tables.ids[num_attention:, rows, 0]
    prompt_rows = [  # only a prefill computes prompt positions
        int(cu_seqlens[i]) + p - r.num_computed_tokens
        for i, r in enumerate(requests if plan.is_prefill else ())
        for p in r.prompt_logprob_positions
    ]
    image_rows = [
        (image.hash, lo - image.offset, int(cu_seqlens[i]) + lo - r.num_computed_tokens, hi - lo)
        for i, r in enumerate(requests if plan.is_prefill else ())
        for image in r.images
        if (lo := max(image.offset, r.num_computed_tokens)) < (hi := min(image.end, r.context_len))
    ]
    return StepInputs(
        is_prefill=plan.is_prefill,
        tokens=tokens,
        cu_seqlens=cu_seqlens.astype(np.int32),
        seqs=seqs,
        block_tables=tables,
        sample_rows=sample_rows.astype(np.int32),
        prompt_rows=np.array(prompt_rows, dtype=np.int64),
        encoder_inputs=[(image.hash, image.pixel_values) for image in plan.encoder_inputs],
        evicted_encoder_hashes=plan.evicted_encoder_hashes,
        image_rows=image_rows,
        key_bounds=_key_bounds(plan, cu_seqlens, positions) if whole_images else None,
    )


def _key_bounds(plan: StepPlan, cu_seqlens: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
    """Each token's last visible key position: its image's last one for the tokens of an
    image (the scheduler keeps an image's run in one step), its own for the others; None
    for a step without image tokens."""
    bounds = None
    for i, r in enumerate(plan.requests if plan.is_prefill else ()):
        for image in r.images:
            lo = max(image.offset, r.num_computed_tokens)
            row = int(cu_seqlens[i]) + lo - r.num_computed_tokens
            if bounds is None:
                bounds = positions.astype(np.int32)
            bounds[row : row + min(image.end, r.context_len) - lo] = image.end - 1
    return bounds


@dataclass
class StepViews:
    """Device views of one staged step, named as the model side uses them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_sources: torch.Tensor
    slot_mappings: torch.Tensor  # (num_attention_groups, num_tokens)
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    has_initial_state: torch.Tensor  # int32, != 0: the state carries over
    state_indices: torch.Tensor | None  # (num_state_groups, num_seqs)
    sample_rows: torch.Tensor
    block_tables: torch.Tensor  # (num_attention_groups, num_seqs, width)

    def context(
        self,
        is_prefill: bool,
        max_seqlen_q: int,
        max_context_len: int,
        key_bounds: torch.Tensor | None = None,
        no_cached_prefix: bool = False,
    ) -> ForwardContext:
        """The step's forward context over these views: attention metadata per attention
        group (their slots and tables; the rest shared, `key_bounds` and
        `no_cached_prefix` too), a Mamba part with state groups."""
        attention = tuple(
            AttentionMetadata(
                is_prefill=is_prefill,
                slot_mapping=slots,
                cu_seqlens_q=self.cu_seqlens,
                context_lens=self.context_lens,
                block_tables=tables,
                max_seqlen_q=max_seqlen_q,
                max_context_len=max_context_len,
                key_bounds=key_bounds,
                no_cached_prefix=no_cached_prefix,
            )
            for slots, tables in zip(self.slot_mappings, self.block_tables, strict=True)
        )
        if self.state_indices is None:
            return ForwardContext(attention)
        carried = self.has_initial_state != 0
        return ForwardContext(
            attention, MambaMetadata(is_prefill, self.cu_seqlens, self.state_indices, carried)
        )


class InputBuffers:
    """The persistent host and device buffers every step's inputs go through."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_width: int,
        num_attention_groups: int,
        num_state_groups: int,
        device: torch.device,
    ) -> None:
        self.num_attention_groups = num_attention_groups
        self.num_state_groups = num_state_groups
        self.max_width = max_width
        self._max = StepShape(max_tokens, max_seqs, max_width)
        size = self._size(self._max)
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pinned)
        # On the CPU the host buffer is what the model reads: nothing to copy.
        self.staged = torch.zeros_like(self.host, device=device) if pinned else self.host
        self._host = self.host.numpy()
        # Set once the last copy out of the host buffer is done: with asynchronous
        # scheduling the next step is staged while the device may not have read it yet.
        self._sent = torch.cuda.Event() if pinned else None

    def _size(self, shape: StepShape) -> int:
        t, s, w = shape.num_tokens, shape.num_seqs, shape.width
        a = self.num_attention_groups
        return (TOKEN_ROWS + a) * t + (s + 1) + (2 + self.num_state_groups) * s + s + a * s * w

    def _split(self, buffer: torch.Tensor | np.ndarray, shape: StepShape, num_sampled: int):
        t, s, w = shape.num_tokens, shape.num_seqs, shape.width
        a = self.num_attention_groups
        rows = 2 + self.num_state_groups
        cu = (TOKEN_ROWS + a) * t
        seqs = cu + s + 1
        sample = seqs + rows * s
        tables = sample + s
        return (
            buffer[:cu].reshape(TOKEN_ROWS + a, t),
            buffer[cu:seqs],
            buffer[seqs:sample].reshape(rows, s),
            buffer[sample : sample + num_sampled],
            buffer[tables : tables + a * s * w].reshape(a, s, w),
        )

    def fits(self, shape: StepShape) -> bool:
        """Whether a step of `shape` fits the buffers sized at start-up."""
        return (
            shape.num_tokens <= self._max.num_tokens
            and shape.num_seqs <= self._max.num_seqs
            and shape.width <= self._max.width
        )

    def views(self, shape: StepShape, num_sampled: int) -> StepViews:
        """Device views of a step of `shape`: the same addresses each time, as graphs need."""
        tokens, cu, seqs, sample, tables = self._split(self.staged, shape, num_sampled)
        return StepViews(
            input_ids=tokens[0],
            positions=tokens[1],
            token_sources=tokens[2],
            slot_mappings=tokens[TOKEN_ROWS:],
            cu_seqlens=cu,
            context_lens=seqs[0],
            has_initial_state=seqs[1],
            state_indices=seqs[2:] if self.num_state_groups else None,
            sample_rows=sample,
            block_tables=tables,
        )

    def stage(self, inputs: StepInputs, shape: StepShape) -> None:
        """Write `inputs` into the host buffer, padded to `shape`, and send them with one
        copy (a graph replay needs no more; an eager step then takes its `views`). Padding
        rows write nothing (slots -1, state rows -1), take their token from the ids row and
        attend to one token of block 0, which both KV cache paths always have committed."""
        if self._sent is not None:
            self._sent.synchronize()
        n, s = inputs.num_tokens, inputs.num_seqs
        width = inputs.width
        tokens, cu, seqs, sample, tables = self._split(self._host, shape, len(inputs.sample_rows))
        tokens[:, :n] = inputs.tokens
        tokens[:TOKEN_ROWS, n:] = ((0,), (0,), (-1,))
        tokens[TOKEN_ROWS:, n:] = -1
        cu[: s + 1] = inputs.cu_seqlens
        cu[s + 1 :] = inputs.cu_seqlens[-1] + np.arange(1, shape.num_seqs - s + 1)
        seqs[:, :s] = inputs.seqs
        seqs[:2, s:] = ((1,), (1,))
        seqs[2:, s:] = -1
        sample[:] = inputs.sample_rows
        tables[:, :s, :width] = inputs.block_tables
        tables[:, :s, width:] = 0
        tables[:, s:] = 0
        if self._sent is not None:
            used = self._size(shape)
            self.staged[:used].copy_(self.host[:used], non_blocking=True)
            self._sent.record(torch.cuda.current_stream(self.staged.device))
