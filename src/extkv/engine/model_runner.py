"""Runs the model on a scheduled batch: builds the paging metadata, runs the
forward pass (eagerly, or by replaying a decode graph) and samples.

Under tensor parallelism every rank has a runner over its shard of the model;
the driver's runner prepares each step and sends its inputs to the others, and
only the driver samples.

A step returns before the device has finished it: its sampled tokens stay on
the device (the next step reads its pending input tokens from there) and come
to the host behind the step (`SampledTokens.get`), so the host can plan the
next step meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import resource
from dataclasses import dataclass, field

import torch
from torch import nn

from extkv.attention import Attention, AttentionMetadata, set_forward_context
from extkv.distributed import SINGLE, TPGroup
from extkv.engine.block_manager import BlockNeeds
from extkv.engine.config import EngineConfig
from extkv.engine.cuda_graphs import (
    DecodeGraphs,
    DecodeInputs,
    decode_batch_sizes,
    free_device_memory,
)
from extkv.engine.sampler import Sampler
from extkv.engine.scheduler import ScheduledBatch
from extkv.engine.sequence import Sequence
from extkv.kv_cache import (
    FullAttentionSpec,
    KVCache,
    KVCacheGroup,
    MambaSpec,
    make_kv_cache_config,
)
from extkv.models import Mamba2Mixer

logger = logging.getLogger(__name__)


@dataclass
class EagerInputs:
    """A step's inputs as host lists, for the eager path (prefill, or decode without
    graphs); small (ids, positions, slots, block tables), so the driver can send them
    to every rank."""

    is_prefill: bool
    max_seqlen_q: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    cu_seqlens: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled
    state_indices: list[list[int]] | None = None  # per state group, per sequence
    has_initial_state: list[bool] | None = None
    # (input row, row of the previous step's sampled tokens) for tokens still pending
    device_tokens: list[tuple[int, int]] = field(default_factory=list)


StepInputs = EagerInputs | DecodeInputs


@dataclass
class SampledTokens:
    """A launched step's sampled tokens, one per sequence of `seqs`, on their way to
    the host; `get` waits for them."""

    seqs: list[Sequence]
    host: torch.Tensor  # int64, written by a copy behind the step
    ready: torch.cuda.Event | None  # None: already there (CPU)

    def get(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: nn.Module, vocab_size: int, tp: TPGroup = SINGLE
    ) -> None:
        self.config = config
        self.model = model
        self.tp = tp
        self.device: torch.device = config.device
        self.vocab_size = vocab_size
        self.attention_layers = {
            name: m for name, m in model.named_modules() if isinstance(m, Attention)
        }
        self.mixers = {name: m for name, m in model.named_modules() if isinstance(m, Mamba2Mixer)}
        if self.attention_layers and self.mixers:
            self._fit_block_size_to_state()
        # Hybrid models cut their Mamba layers into groups; each group keeps its own
        # state block per sequence (see extkv.kv_cache.config).
        groups = make_kv_cache_config(self.kv_cache_groups(), 1).groups
        if sum(g.spec.kind == "attention" for g in groups) > 1:
            raise ValueError(
                f"hybrid models with more attention layers ({len(self.attention_layers)}) than "
                f"Mamba layers ({len(self.mixers)}) are not supported: their attention layers "
                "would need one block table each"
            )
        state_groups = [g.layer_names for g in groups if g.spec.kind == "mamba"]
        for index, names in enumerate(state_groups):
            for name in names:
                self.mixers[name].state_group = index
        self.needs = BlockNeeds(
            config.block_size, bool(self.attention_layers), num_state_groups=len(state_groups)
        )
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self.graphs: DecodeGraphs | None = None
        # The last sampled tokens stay on the device for the next step's inputs; two host
        # buffers take turns receiving them, so a step's copy never overwrites tokens the
        # host has not read yet.
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int32, device=self.device)
        self._last_rows: dict[Sequence, int] = {}  # row of each sequence in last_tokens
        pinned = self.device.type == "cuda"
        self._host_tokens = [
            torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=pinned) for _ in range(2)
        ]
        self.num_steps = 0  # steps launched

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager

    def weights_bytes(self) -> int:
        """Bytes of the model's parameters and buffers, tied tensors counted once."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())

    def _attention_spec(self) -> FullAttentionSpec:
        first = next(iter(self.attention_layers.values()))
        return FullAttentionSpec(
            block_size=self.config.block_size,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_dim,
            dtype=self.config.dtype,
        )

    def _state_spec(self) -> MambaSpec:
        first = next(iter(self.mixers.values()))
        return MambaSpec(self.config.block_size, first.state_shapes(), first.state_dtypes())

    def _fit_block_size_to_state(self) -> None:
        """Hybrid models share pages between attention and Mamba state, so an attention
        page must hold a whole state: raise block_size to the next power of two that does."""
        attention = self._attention_spec()
        state_bytes = self._state_spec().page_size_bytes
        if state_bytes <= attention.page_size_bytes:
            return
        per_token = attention.page_size_bytes // attention.block_size
        block_size = 1 << (-(-state_bytes // per_token) - 1).bit_length()
        logger.info(
            "Raised block_size from %d to %d so that one attention page holds a %d-byte "
            "Mamba state.",
            self.config.block_size,
            block_size,
            state_bytes,
        )
        self.config.block_size = block_size

    def kv_cache_groups(self) -> list[KVCacheGroup]:
        groups = []
        if self.attention_layers:
            groups.append(KVCacheGroup(list(self.attention_layers), self._attention_spec()))
        if self.mixers:
            groups.append(KVCacheGroup(list(self.mixers), self._state_spec()))
        return groups

    def bind_kv_cache(self, cache: KVCache) -> None:
        for name, layer in self.attention_layers.items():
            layer.k_cache, layer.v_cache = cache.kv_views(name)
        for name, mixer in self.mixers.items():
            mixer.ssm_state, mixer.conv_state = cache.layer_views[name]

    # --- memory profiling --------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Run the largest step the scheduler can form (max_num_batched_tokens tokens over
        up to max_num_seqs prompts) and return its peak activation memory in bytes."""
        cfg = self.config
        # As many sequences as a step may sample from, none longer than max_model_len.
        num_seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        total = min(cfg.max_num_batched_tokens, num_seqs * cfg.max_model_len)
        lengths = [total // num_seqs + (i < total % num_seqs) for i in range(num_seqs)]
        metadata = AttentionMetadata.packed_prefill(lengths, self.device)
        input_ids = torch.zeros(total, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        before = self._memory_high_water_mark(reset=True)
        with set_forward_context(metadata):
            hidden = self.model(input_ids, positions)
        last_tokens = metadata.cu_seqlens_q[1:].long() - 1
        logits = self.model.compute_logits(hidden[last_tokens])
        logits.argmax(dim=-1)
        del hidden, logits
        peak = max(self._memory_high_water_mark(reset=False) - before, 0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the peak is budgeted apart; don't count it as in use too
        return peak

    def _memory_high_water_mark(self, reset: bool) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if reset:
                torch.cuda.reset_peak_memory_stats(self.device)
                return torch.cuda.memory_allocated(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        # The CPU has no allocator statistics: the process's peak resident set grows
        # only when a step needs more than any step before it.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # --- CUDA graphs ---------------------------------------------------------------------

    def capture_cudagraphs(self, batch_sizes: list[int] | None = None) -> int:
        """Set up the static decode path and capture its graphs (CUDA); return the
        device memory the capture took. `enforce_eager` keeps decode fully eager."""
        if self.config.enforce_eager:
            return 0
        cuda = self.device.type == "cuda"
        before = free_device_memory(self.device) if cuda else 0
        self.graphs = DecodeGraphs(
            self.model,
            decode_batch_sizes(self.config.max_num_seqs),
            self.max_blocks_per_seq,
            self.config.max_model_len,
            self.vocab_size,
            self.device,
            self.config.block_size,
            self.last_tokens,
            self.needs.num_state_groups,
        )
        self.graphs.capture(batch_sizes)
        return max(before - free_device_memory(self.device), 0) if cuda else 0

    def release_cudagraphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Drop the graphs and every reference to the KV cache and the weights."""
        self.release_cudagraphs()
        for layer in self.attention_layers.values():
            layer.k_cache = layer.v_cache = torch.empty(0)
        for mixer in self.mixers.values():
            mixer.ssm_state = mixer.conv_state = torch.empty(0)
        self.attention_layers.clear()
        self.mixers.clear()
        self.model = None

    # --- one step ------------------------------------------------------------------------

    def _prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """The step's inputs on the host, and the sequences whose next token it samples."""
        seqs = batch.seqs
        graphs = self.graphs
        rows = self._last_rows
        if not batch.is_prefill and graphs is not None and len(seqs) <= graphs.batch_sizes[-1]:
            sources = [rows[seq] if seq.num_pending else -1 for seq in seqs]
            return graphs.inputs(seqs, sources), seqs
        # Flatten the new tokens; note which rows finish a sequence's context.
        block_size = self.config.block_size
        inputs = EagerInputs(batch.is_prefill, max(batch.num_new_tokens))
        sampled_seqs: list[Sequence] = []
        for seq, n in zip(seqs, batch.num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            inputs.input_ids += seq.token_ids[start:end]
            if end > len(seq.token_ids):  # decode of the token the last step sampled
                inputs.device_tokens.append((len(inputs.input_ids), rows[seq]))
                inputs.input_ids.append(0)
            inputs.positions += range(start, end)
            inputs.slots += [seq.slot(p, block_size) for p in range(start, end)]
            inputs.cu_seqlens.append(inputs.cu_seqlens[-1] + n)
            inputs.context_lens.append(end)
            if end == len(seq):
                inputs.sample_rows.append(inputs.cu_seqlens[-1] - 1)
                sampled_seqs.append(seq)
        width = max(len(seq.block_table) for seq in seqs)
        inputs.block_tables = [
            seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs
        ]
        if self.needs.num_state_groups:
            groups = range(self.needs.num_state_groups)
            inputs.state_indices = [[seq.state_blocks[g] for seq in seqs] for g in groups]
            inputs.has_initial_state = [seq.num_computed_tokens > 0 for seq in seqs]
        return inputs, sampled_seqs

    def _forward_eager(self, inputs: EagerInputs) -> torch.Tensor | None:
        """Logits of the sample rows (None: the step samples nothing)."""
        as_tensor = lambda data, dtype: torch.tensor(data, dtype=dtype).to(  # noqa: E731
            self.device, non_blocking=True
        )
        metadata = AttentionMetadata(
            is_prefill=inputs.is_prefill,
            slot_mapping=as_tensor(inputs.slots, torch.int64),
            cu_seqlens_q=as_tensor(inputs.cu_seqlens, torch.int32),
            context_lens=as_tensor(inputs.context_lens, torch.int32),
            block_tables=as_tensor(inputs.block_tables, torch.int32),
            max_seqlen_q=inputs.max_seqlen_q,
            max_context_len=max(inputs.context_lens),
        )
        if inputs.state_indices is not None:
            metadata.state_indices = as_tensor(inputs.state_indices, torch.int32)
            metadata.has_initial_state = as_tensor(inputs.has_initial_state, torch.bool)
        ids = as_tensor(inputs.input_ids, torch.int64)
        if inputs.device_tokens:
            at, source = as_tensor(inputs.device_tokens, torch.int64).T
            ids[at] = self.last_tokens[source].long()
        with set_forward_context(metadata):
            hidden = self.model(ids, as_tensor(inputs.positions, torch.int64))
        if not inputs.sample_rows:
            return None
        return self.model.compute_logits(
            hidden[torch.tensor(inputs.sample_rows, device=self.device)]
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Run one step on this rank: (fp32 logits, greedy tokens if already known) of the
        rows it samples, None when it samples none. Every rank runs every step."""
        if isinstance(inputs, DecodeInputs):
            return self.graphs.run(inputs)
        logits = self._forward_eager(inputs)
        return None if logits is None else (logits, None)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SampledTokens:
        """Launch one step (on every rank) and its sampling; return the tokens on their
        way to the host, one for every sequence that produced one."""
        inputs, sampled_seqs = self._prepare(batch)
        if self.tp.size > 1:
            self.tp.broadcast_object(inputs)  # the workers' step (extkv.engine.workers)
        result = self.forward(inputs)
        host = self._host_tokens[self.num_steps % 2][: len(sampled_seqs)]
        self.num_steps += 1
        self._last_rows = {seq: row for row, seq in enumerate(sampled_seqs)}
        if result is None:
            return SampledTokens([], host, None)
        logits, greedy = result
        params = [s.params for s in sampled_seqs]
        tokens = self.sampler(logits, params, [s.generator for s in sampled_seqs], greedy)
        self.last_tokens[: len(tokens)] = tokens
        host.copy_(tokens, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))  # not the current device's
        return SampledTokens(sampled_seqs, host, ready)
