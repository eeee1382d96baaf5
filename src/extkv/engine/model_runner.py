"""Runs the model on a step plan: stages its inputs, runs the forward pass
(eagerly, or by replaying a decode graph) and samples.

The runner reads only the `StepPlan` (never the scheduler's requests) and owns
everything on the device side: the weights, the KV cache views, the input
buffers both paths read, the sampled tokens of the last step and the seeded
requests' generators.

Under tensor parallelism every rank has a runner over its shard of the model;
the driver's runner builds each step's inputs and sends them to the others,
and only the driver samples.

A step returns before the device has finished it: its sampled tokens stay on
the device (the next step reads its pending input tokens from there) and come
to the host behind the step (`SampledTokens.get`), so the host can plan the
next step meanwhile.

A vision-language model's runner also holds the encoder cache's tensors: each prefill
step drops the entries its plan evicts, encodes its new images in one batch, and runs
the model on embeddings where its tokens are image tokens (for Gemma 3 with each image's
tokens seeing the whole image: key bounds). Decode steps (and their graphs) never see an
image.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from extkv.attention import Attention, ForwardContext, MLAAttention, set_forward_context
from extkv.distributed import SINGLE, TPGroup
from extkv.engine.config import EngineConfig
from extkv.engine.cuda_graphs import DecodeGraphs, decode_batch_sizes, free_device_memory
from extkv.engine.encoder_cache import encoder_budget
from extkv.engine.host_memory import peak_resident_bytes, reset_peak_resident, resident_bytes
from extkv.engine.sampler import Sampler, TopLogprobs, top_logprobs
from extkv.engine.sampling_batch import SamplingBatch
from extkv.engine.step_inputs import (
    InputBuffers,
    StepInputs,
    StepShape,
    StepViews,
    build_step_inputs,
)
from extkv.engine.step_plan import ScheduledRequest, StepPlan
from extkv.engine.weight_memory import WeightMemory
from extkv.kv_cache import KVCache
from extkv.kv_cache.plan import KVCachePlan, plan_kv_cache
from extkv.models import Mamba2Mixer, ops

logger = logging.getLogger(__name__)


def cache_layers(
    model: nn.Module,
) -> tuple[dict[str, Attention | MLAAttention], dict[str, Mamba2Mixer]]:
    """The model's layers that keep a cache: attention layers (MLA's too) and Mamba mixers,
    by name."""
    modules = dict(model.named_modules())
    attention = {name: m for name, m in modules.items() if isinstance(m, (Attention, MLAAttention))}
    mixers = {name: m for name, m in modules.items() if isinstance(m, Mamba2Mixer)}
    return attention, mixers


def profile_lengths(total: int, num_seqs: int, max_len: int, chunk: int | None) -> list[int]:
    """The sequence lengths of the profiling step: `total` tokens over `num_seqs`
    sequences of at most `max_len`, spread evenly; for a model with Mamba layers
    (`chunk`: the longest chunk their scan cuts), the spread a step can form that cuts
    the most chunks, the longest ones: a token each, then whole chunks to one sequence
    after another. The scan's per-chunk buffers grow with both (an even spread of 8192
    tokens over 256 sequences cuts 256 chunks of 32 tokens; this one 287 of 256)."""
    if chunk is None:
        return [total // num_seqs + (i < total % num_seqs) for i in range(num_seqs)]
    lengths = [1] * num_seqs
    left = total - num_seqs
    for i in range(num_seqs):  # whole chunks after each one's first token, while they fit
        whole = min((max_len - 1) // chunk, left // chunk) * chunk
        lengths[i] += whole
        left -= whole
    for i in range(num_seqs):  # what is left cuts no chunk more: wherever it fits
        more = min(max_len - lengths[i], left)
        lengths[i] += more
        left -= more
    return lengths


def make_kv_cache_plan(model: nn.Module, config: EngineConfig) -> KVCachePlan:
    """The KV cache plan of `model` under `config` (see extkv.kv_cache.plan)."""
    attention, mixers = cache_layers(model)
    return plan_kv_cache(attention, mixers, config.dtype, config.block_size, config.kv_layout)


@dataclass
class SampledTokens:
    """A launched step's sampled tokens, one per request of `request_ids`, on their way
    to the host (`get` waits for them); with the logprobs of the rows `logprob_rows` and
    the prompt logprobs of `prompt_spans` (request id, first position, count), in order."""

    request_ids: list[str]
    host: torch.Tensor  # int32, written by a copy behind the step
    ready: torch.cuda.Event | None  # None: already there (CPU)
    logprobs: TopLogprobs | None = None
    logprob_rows: list[int] = field(default_factory=list)
    prompt_logprobs: TopLogprobs | None = None
    prompt_spans: list[tuple[str, int, int]] = field(default_factory=list)

    def get(self) -> list[int]:
        """The tokens, waiting for their copy (and the logprobs') to the host to land."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


@dataclass
class Profile:
    """What the profiling run measured: the largest step's activation peak (the encoder's
    included, the encoder cache not), and for a vision-language model the encoder's own
    peak over the largest image batch and the encoder cache it reserved."""

    activation_peak_bytes: int
    encoder_activation_peak_bytes: int = 0
    encoder_cache_tokens: int = 0
    encoder_cache_bytes: int = 0


@dataclass
class StepLogits:
    """What a step's forward pass gives the sampler: None where the step has no such rows."""

    logits: torch.Tensor | None = None  # (sampled rows, vocab)
    greedy: torch.Tensor | None = None  # their argmax, when the decode graph computed it
    prompt: torch.Tensor | None = None  # (prompt-logprob rows, vocab)


class ModelRunner:
    """One rank's model on its device: runs step plans, profiles memory, captures the
    decode graphs, holds the views of its KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        kv_plan: KVCachePlan,
        vocab_size: int,
        tp: TPGroup = SINGLE,
        weights: WeightMemory | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.weights = weights  # sleep mode: where the model's tensors live
        self.kv_plan = kv_plan
        self.tp = tp
        self.device: torch.device = config.device
        self.vocab_size = vocab_size
        self.activation_peak_bytes = 0  # measured by profile_run
        self.attention_layers, self.mixers = cache_layers(model)
        # Each layer reads its KV cache group's part of a step's inputs.
        for index, group in enumerate(kv_plan.attention_groups):
            for name in group.layer_names:
                self.attention_layers[name].kv_group = index
        self.image_spec = getattr(model, "image_spec", None)  # None: a model without images
        # An image's tokens see each other (Gemma 3): a prefill step computes it whole.
        self.whole_images = self.image_spec is not None and self.image_spec.bidirectional
        if self.whole_images and config.max_num_batched_tokens < self.image_spec.num_tokens:
            raise ValueError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} is below the "
                f"{self.image_spec.num_tokens} tokens of one image, which this model's "
                "prefill computes in one step (its image tokens attend to each other): raise "
                "max_num_batched_tokens (--max-num-batched-tokens)"
            )
        self.encoder_outputs: dict[str, torch.Tensor] = {}  # the encoder cache, by image hash
        for index, group in enumerate(kv_plan.state_groups):
            for name in group.layer_names:
                self.mixers[name].state_group = index
        self.max_blocks_per_seq = -(-config.max_model_len // kv_plan.block_size)
        max_seqs = config.max_num_seqs
        self.buffers = InputBuffers(
            max(config.max_num_batched_tokens, max_seqs),
            max_seqs,
            self.max_blocks_per_seq,
            len(kv_plan.attention_groups),
            len(kv_plan.state_groups),
            self.device,
        )
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' own
        self.graphs: DecodeGraphs | None = None
        self.logits = torch.zeros(max_seqs, vocab_size, dtype=torch.float32, device=self.device)
        # The last sampled tokens stay on the device for the next step's inputs (the decode
        # graph stores its greedy tokens there itself); two host buffers take turns
        # receiving them, so a step's copy never overwrites tokens the host has not read yet.
        self.last_tokens = torch.zeros(max_seqs, dtype=torch.int32, device=self.device)
        self._last_rows: dict[str, int] = {}  # row of each request's token in last_tokens
        pinned = self.device.type == "cuda"
        self._host_tokens = [
            torch.zeros(max_seqs, dtype=torch.int32, pin_memory=pinned) for _ in range(2)
        ]
        self.num_steps = 0  # steps launched

    @property
    def min_blocks(self) -> int:
        """The most blocks one sequence of max_model_len tokens holds at once, over every KV
        cache group: fewer in the pool and it could never run."""
        config = self.config
        return self.kv_plan.blocks_per_seq(config.max_model_len, config.max_num_batched_tokens)

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode replays captured graphs: on CUDA only, and not under `enforce_eager`."""
        return self.device.type == "cuda" and not self.config.enforce_eager

    def weights_bytes(self) -> int:
        """Bytes of the model's parameters and buffers, tied tensors counted once."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())

    def bind_kv_cache(self, cache: KVCache) -> None:
        """Point every attention layer and Mamba mixer at its views of `cache`; unbound, they
        run without one (the profiling run)."""
        for name, layer in self.attention_layers.items():
            layer.k_cache, layer.v_cache = cache.kv_views(name)
        for name, mixer in self.mixers.items():
            mixer.ssm_state, mixer.conv_state = cache.layer_views[name]

    # --- memory profiling --------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> Profile:
        """Run the largest step the scheduler can form (max_num_batched_tokens tokens over
        up to max_num_seqs prompts, see profile_lengths) and measure its peak activation
        memory. With images, the encoder cache is reserved whole first, the largest image
        batch the budget allows is encoded into it, and the step runs on embeddings taken
        from it."""
        cfg = self.config
        # As many sequences as a step may sample from, none longer than max_model_len.
        num_seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        total = min(cfg.max_num_batched_tokens, num_seqs * cfg.max_model_len)
        chunk = max((m.dims.chunk_size for m in self.mixers.values()), default=None)
        lengths = profile_lengths(total, num_seqs, cfg.max_model_len, chunk)
        groups = len(self.kv_plan.attention_groups)
        context = ForwardContext.packed_prefill(lengths, self.device, groups)
        input_ids = torch.zeros(total, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
        logger.info(
            "Profiling memory: one step of %d tokens over %d sequences (the longest %d).",
            total,
            num_seqs,
            max(lengths),
        )
        profile = Profile(0)
        reserved = self._reserve_encoder_cache(profile)
        before = self._memory_high_water_mark(reset=True)
        embeds = None
        if reserved is not None:
            profile.encoder_activation_peak_bytes = self._profile_encoder(reserved, before)
            embeds = self.model.embed_input_ids(input_ids)
            rows = min(total, len(reserved))
            embeds[:rows] = reserved[:rows]
        with set_forward_context(context):
            if embeds is None:
                hidden = self.model(input_ids, positions)
            else:
                hidden = self.model(input_ids, positions, embeds)
        last_tokens = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last_tokens])
        logits.argmax(dim=-1)
        del hidden, logits, embeds, reserved
        profile.activation_peak_bytes = max(self._memory_high_water_mark(reset=False) - before, 0)
        self.activation_peak_bytes = profile.activation_peak_bytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the peak is budgeted apart; don't count it as in use too
        return profile

    def hold_activation_memory(self) -> None:
        """On CUDA, keep the profiled activation peak in torch's allocator cache (allocated
        and freed at once), so that eager steps take their activations from it and not
        from the driver, where another process (an elastic engine beside this one) may
        have taken the memory since start-up gave it back."""
        if self.device.type != "cuda" or not self.activation_peak_bytes:
            return
        try:
            torch.empty(self.activation_peak_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:  # taken meanwhile (a wake): the steps try again
            logger.warning(
                "Could not hold the %.3f GiB activation peak in torch's cache: the device is "
                "full; the eager steps will allocate it as they run.",
                self.activation_peak_bytes / (1 << 30),
            )

    def release_activation_memory(self) -> None:
        """Give torch's cached memory back to the driver (sleep: memory for others)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _reserve_encoder_cache(self, profile: Profile) -> torch.Tensor | None:
        """The whole encoder cache as one tensor (touched, so that the CPU's resident set
        counts it), its size noted in `profile`; None without images."""
        spec = self.image_spec
        if spec is None:
            return None
        tokens = encoder_budget(self.config.max_num_batched_tokens, spec)
        reserved = torch.zeros(
            tokens, spec.hidden_size, dtype=self.config.dtype, device=self.device
        )
        profile.encoder_cache_tokens = tokens
        profile.encoder_cache_bytes = reserved.numel() * reserved.element_size()
        return reserved

    def _profile_encoder(self, reserved: torch.Tensor, before: int) -> int:
        """Encode the largest image batch a step may (blank images) into `reserved`; the
        peak memory it took above `before`."""
        spec = self.image_spec
        num_images = len(reserved) // spec.num_tokens
        logger.info("Profiling memory: encoding %d images.", num_images)
        pixels = torch.zeros(num_images, *spec.pixel_shape, device=self.device)
        embeddings = self.model.encode_images(pixels)
        reserved[: num_images * spec.num_tokens] = embeddings.flatten(0, 1)
        del pixels, embeddings
        return max(self._memory_high_water_mark(reset=False) - before, 0)

    def _memory_high_water_mark(self, reset: bool) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if reset:
                torch.cuda.reset_peak_memory_stats(self.device)
                return torch.cuda.memory_allocated(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        # The CPU has no allocator statistics: the growth of the process's peak resident
        # set (reset first where the OS allows, so loading's peak does not hide the step's).
        if reset and reset_peak_resident():
            return resident_bytes()
        return peak_resident_bytes()

    # --- CUDA graphs ---------------------------------------------------------------------

    def capture_cudagraphs(self, batch_sizes: list[int] | None = None) -> int:
        """Set up the static decode path and capture its graphs (CUDA); return the
        device memory the capture took. `enforce_eager` keeps decode fully eager."""
        if self.config.enforce_eager:
            return 0
        cuda = self.device.type == "cuda"
        before = free_device_memory(self.device) if cuda else 0
        self.graphs = DecodeGraphs(
            decode_batch_sizes(self.config.max_num_seqs), self._decode, self._pad, self.device
        )
        self.graphs.capture(batch_sizes)
        return max(before - free_device_memory(self.device), 0) if cuda else 0

    def release_cudagraphs(self) -> None:
        """Free the captured graphs and their memory pool; decode runs eagerly until the next
        capture."""
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
        self.encoder_outputs.clear()
        self.model = None
        if self.weights is not None:
            self.weights.free()

    # --- one step ------------------------------------------------------------------------

    def _hidden(
        self,
        context: ForwardContext,
        views: StepViews,
        image_rows: list[tuple[str, int, int, int]] | None = None,
    ) -> torch.Tensor:
        """The forward pass over staged inputs; pending input tokens come from the device,
        the embeddings of `image_rows` from the encoder cache."""
        input_ids = ops.pending_tokens(views.input_ids, views.token_sources, self.last_tokens)
        with set_forward_context(context):
            if not image_rows:
                return self.model(input_ids, views.positions)
            embeds = self.model.embed_input_ids(input_ids)
            for hash_, first, row, count in image_rows:
                embeds[row : row + count] = self.encoder_outputs[hash_][first : first + count]
            return self.model(input_ids, views.positions, embeds)

    def _update_encoder_cache(self, inputs: StepInputs) -> None:
        """Drop the evicted entries, then encode the step's new images (one batch) into
        entries of their own."""
        for hash_ in inputs.evicted_encoder_hashes:
            self.encoder_outputs.pop(hash_, None)
        if not inputs.encoder_inputs:
            return
        pixels = torch.stack([p for _, p in inputs.encoder_inputs]).to(self.device)
        embeddings = self.model.encode_images(pixels)
        several = len(inputs.encoder_inputs) > 1
        for (hash_, _), rows in zip(inputs.encoder_inputs, embeddings, strict=True):
            # A copy each, so that evicting one entry frees its memory.
            self.encoder_outputs[hash_] = rows.clone() if several else rows

    def _pad(self, bs: int) -> None:
        """Stage a decode batch of `bs` padding rows (no request: nothing is written)."""
        empty = build_step_inputs(StepPlan(False, []), self.kv_plan, {})
        self.buffers.stage(empty, self._decode_shape(bs))

    def _decode_shape(self, bs: int) -> StepShape:
        return StepShape.decode(bs, self.max_blocks_per_seq)

    def _decode(self, bs: int) -> None:
        """The static decode step of `bs` staged rows (what the graphs capture): logits into
        a persistent output, greedy tokens into `last_tokens`, where the next step reads
        them (the sampler replaces the rows it samples otherwise)."""
        views = self.buffers.views(self._decode_shape(bs), 0)
        context = views.context(False, 1, self.config.max_model_len)
        logits = self.model.compute_logits(self._hidden(context, views), fp32=False)
        ops.store_logits_and_argmax(logits, self.logits[:bs], self.last_tokens[:bs])

    def _uses_graph(self, inputs: StepInputs) -> bool:
        return (
            not inputs.is_prefill
            and self.graphs is not None
            and inputs.num_seqs <= self.graphs.batch_sizes[-1]
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> StepLogits:
        """Run one step on this rank: the fp32 logits of the rows it samples (and the greedy
        tokens if already known) and of its prompt-logprob rows. Every rank runs every step."""
        n = inputs.num_seqs
        if inputs.evicted_encoder_hashes or inputs.encoder_inputs:
            self._update_encoder_cache(inputs)
        if self._uses_graph(inputs):
            bs = self.graphs.padded_size(n)
            self.buffers.stage(inputs, self._decode_shape(bs))
            self.graphs.run(bs)
            return StepLogits(self.logits[:n], self.last_tokens[:n])
        shape = StepShape(inputs.num_tokens, n, inputs.width)
        self.buffers.stage(inputs, shape)
        views = self.buffers.views(shape, len(inputs.sample_rows))
        key_bounds = None
        if inputs.key_bounds is not None:
            key_bounds = torch.from_numpy(inputs.key_bounds).to(self.device)
        context = views.context(
            inputs.is_prefill,
            int((inputs.cu_seqlens[1:] - inputs.cu_seqlens[:-1]).max()),
            int(inputs.seqs[0].max()),
            key_bounds,
            inputs.no_cached_prefix,
        )
        hidden = self._hidden(context, views, inputs.image_rows)
        result = StepLogits()
        if len(inputs.prompt_rows):
            rows = torch.from_numpy(inputs.prompt_rows).to(self.device)
            result.prompt = self.model.compute_logits(hidden[rows])
        if not len(inputs.sample_rows):
            return result
        if inputs.is_prefill:
            hidden = hidden[views.sample_rows]  # a decode samples every row
        result.logits = self.model.compute_logits(hidden)
        return result

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> SampledTokens:
        """Launch one step (on every rank) and its sampling; return the tokens on their
        way to the host, one for every request that produced one, and the logprobs asked."""
        for request_id in plan.finished_request_ids:
            self._generators.pop(request_id, None)
        last_rows = self._last_rows
        inputs = build_step_inputs(plan, self.kv_plan, last_rows, self.whole_images)
        if not self.buffers.fits(StepShape(inputs.num_tokens, inputs.num_seqs, 0)):
            raise ValueError(
                f"a step of {inputs.num_tokens} tokens over {inputs.num_seqs} sequences exceeds "
                "max_num_batched_tokens / max_num_seqs"
            )
        if self.tp.size > 1:
            self.tp.broadcast_object(inputs)  # the workers' step (extkv.engine.workers)
        sampled = plan.sampled
        # Built before the step runs: penalties read the pending tokens from last_tokens,
        # which a decode graph overwrites with its own.
        batch = SamplingBatch.build(
            sampled, self._generator, self.vocab_size, self.last_tokens, last_rows
        )
        result = self.forward(inputs)
        host = self._host_tokens[self.num_steps % 2][: len(sampled)]
        self.num_steps += 1
        request_ids = [r.request_id for r in sampled]
        self._last_rows = dict(zip(request_ids, range(len(request_ids)), strict=True))
        out = SampledTokens(request_ids, host, None)
        if result.prompt is not None:
            out.prompt_spans, out.prompt_logprobs = self._prompt_logprobs(plan, result.prompt)
        if result.logits is not None:
            sample = self.sampler(result.logits, batch, result.greedy)
            tokens = self.last_tokens[: len(sampled)]
            if sample.tokens is not result.greedy:  # else the graph's tokens are there
                tokens.copy_(sample.tokens)
            host.copy_(tokens, non_blocking=True)
            if sample.logprobs is not None:
                out.logprobs, out.logprob_rows = sample.logprobs.to_host(), batch.logprob_rows
        if self.device.type == "cuda":
            out.ready = torch.cuda.Event()
            out.ready.record(torch.cuda.current_stream(self.device))  # not the current device's
        return out

    def _prompt_logprobs(
        self, plan: StepPlan, logits: torch.Tensor
    ) -> tuple[list[tuple[str, int, int]], TopLogprobs]:
        """The prompt logprobs of a step's prompt rows (in `build_step_inputs`' order), with
        (request id, first prompt position, count) for each request they belong to."""
        spans, targets, ks = [], [], []
        for r in plan.requests:
            positions = r.prompt_logprob_positions
            if positions:
                spans.append((r.request_id, positions.start + 1, len(positions)))
                targets += r.history[positions.start + 1 : positions.stop + 1]
                ks.append(r.prompt_logprobs)
        chosen = torch.tensor(targets, device=self.device)
        return spans, top_logprobs(logits, chosen, max(ks)).to_host()

    def _generator(self, request: ScheduledRequest) -> torch.Generator | None:
        """A seeded request's own generator, made when it first samples: its tokens then
        do not depend on what else is in the batch."""
        seed = request.sampling.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator
