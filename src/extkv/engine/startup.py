"""Start-up: how big the KV cache gets, and in which order things happen.

Both flows begin with a profiling run at the largest batch, which gives the
memory that is really available for the KV cache and the CUDA graphs:
`available = budget - memory in use (weights, context, ...) - activation peak`.
A vision-language model's profile also reserves its whole encoder cache and encodes
the largest image batch a step may; the cache's size comes off `available` too, so the
KV cache sized afterwards (by either flow) never takes the images' memory.

legacy      estimate the graph pool with a throwaway capture -> allocate the
            whole KV cache from the estimate -> capture the graphs for real.
extensible  reserve address space for `available` -> commit one block per
            segment -> capture the graphs against those stable addresses ->
            measure what the capture took -> size -> extend under the same
            base pointer.

Under tensor parallelism every rank runs its flow on its own device and
measures its own graph memory; where a flow settles the block count, the ranks
take the smallest of theirs (every rank's block tables are the driver's), and
each extends its own cache to it.
"""

from __future__ import annotations

import gc
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import torch

from extkv.distributed import TPGroup
from extkv.engine.config import EngineConfig
from extkv.engine.cuda_graphs import decode_batch_sizes, free_device_memory
from extkv.engine.errors import StartupError
from extkv.engine.host_memory import keep_freed_memory
from extkv.engine.kv_policy import floor_blocks
from extkv.engine.model_runner import ModelRunner, make_kv_cache_plan
from extkv.engine.weight_memory import WeightMemory
from extkv.kv_cache import KVCache
from extkv.models import ModelFacts, load_model, model_facts
from extkv.vmm import VirtualMemoryError, allocation_granularity

logger = logging.getLogger(__name__)

GiB = 1 << 30
T = TypeVar("T")
# Headroom kept free by the extensible sizing on CUDA, for allocations that
# appear after start-up (allocator fragmentation, cuBLAS workspaces of new
# shapes); see BENCHMARKS.md for the measurement behind it.
DEFAULT_CUDA_MARGIN_BYTES = 256 << 20


@dataclass
class MemoryReport:
    """What start-up decided and measured: the KV cache's size and where the memory and
    the time went (`LLM.memory_report()` returns it as a dict)."""

    extensible: bool
    block_size: int
    bytes_per_block: int
    weights_bytes: int
    activation_peak_bytes: int  # the largest step's, the encoder's included
    available_bytes: int
    margin_bytes: int
    # Vision-language models: the encoder cache kept out of `available` (its budget in
    # embeddings, and bytes), and the encoder's own peak over the largest image batch.
    encoder_cache_tokens: int = 0
    encoder_cache_bytes: int = 0
    encoder_activation_peak_bytes: int = 0
    # Committed: blocks the engine can hand out now. Capacity: blocks the reserved
    # address space holds (extensible), or the committed count (legacy).
    num_blocks_committed: int = 0
    num_blocks_capacity: int = 0
    # Ceiling: blocks the memory budget allows; the elastic policy commits fewer at
    # start-up (its floor) and grows up to it. Static: the committed count.
    num_blocks_ceiling: int = 0
    kv_cache_bytes: int = 0
    kv_reserved_bytes: int = 0
    kv_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    # Per KV cache group (KVCachePlan.group_sizing): kind, layers, spec, page and block
    # bytes, and what one max_model_len sequence holds of the shared blocks at most.
    kv_cache_groups: list[dict[str, object]] = field(default_factory=list)
    graph_pool_bytes: int = 0
    graph_pool_bytes_per_rank: list[int] = field(default_factory=list)
    graph_pool_estimate_bytes: int | None = None
    # Where start-up time goes: loading weights, the profiling run, the whole KV
    # setup (legacy: estimate + allocate + capture; extensible: reserve + capture
    # + extend), and within it the graph capture and the extend.
    startup_seconds: float = 0.0
    load_seconds: float = 0.0
    profile_seconds: float = 0.0
    kv_setup_seconds: float = 0.0
    capture_seconds: float = 0.0
    extend_seconds: float = 0.0

    @property
    def num_blocks(self) -> int:
        """The blocks in use now: `num_blocks_committed`."""
        return self.num_blocks_committed

    def as_dict(self) -> dict[str, object]:
        """The fields, plus `num_blocks` (= `num_blocks_committed`) as earlier reports had."""
        return {**asdict(self), "num_blocks": self.num_blocks}


def use_extensible(config: EngineConfig) -> bool:
    """Resolve enable_extensible_kv_cache, probing the device's VMM support for "auto"."""
    if (
        config.enable_extensible_kv_cache is not True
        and config.enable_extensible_kv_cache != "auto"
    ):
        return False
    if config.enable_extensible_kv_cache == "auto" and config.kv_cache_memory_bytes is not None:
        return False
    try:
        allocation_granularity(config.device)  # builds the backend: fails without VMM
    except VirtualMemoryError as e:
        if config.enable_extensible_kv_cache is True:
            raise RuntimeError(
                f"enable_extensible_kv_cache=True needs CUDA virtual memory on {config.device}: {e}"
            ) from e
        warnings.warn(
            f"no virtual memory management on {config.device} ({e}); using the legacy KV cache",
            stacklevel=3,
        )
        return False
    return True


def free_memory_at_start(config: EngineConfig) -> int:
    """Free device memory before the engine takes any: what others hold is not ours
    to budget. Call before the weights are loaded. What torch caches in this process
    without using it (say, a checkpoint just built on the device) goes back to the
    driver first: counted as held by others, it would be given back later, during the
    profile, and the engine would then budget it as well, past gpu_memory_utilization."""
    if config.device.type != "cuda":
        return 0
    gc.collect()  # tensors already unreachable still hold their blocks until collected
    return free_device_memory(config.device)


def _memory_in_use(
    runner: ModelRunner, config: EngineConfig, free_at_start: int
) -> tuple[int, int]:
    """(budget, bytes this engine already uses) on its device."""
    if config.device.type != "cuda":
        return config.cpu_memory_budget_bytes, runner.weights_bytes()
    free, total = torch.cuda.mem_get_info(config.device)
    budget = int(total * config.gpu_memory_utilization)
    held_by_others = total - free_at_start
    if held_by_others + budget > total:
        raise StartupError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} asks for "
            f"{budget / GiB:.2f} GiB of {config.device}, but only {free_at_start / GiB:.2f} GiB "
            "were free when the engine started; lower gpu_memory_utilization "
            "(--gpu-memory-utilization)"
        )
    return budget, free_at_start - free


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


REMEDY = (
    "lower max_model_len (--max-model-len) or max_num_seqs (--max-num-seqs), raise "
    "gpu_memory_utilization (--gpu-memory-utilization; on the CPU cpu_memory_budget_bytes, "
    "--cpu-memory-budget-bytes), or use a smaller model"
)


def _check_fits(num_blocks: int, runner: ModelRunner, bytes_per_block: int, what: str) -> None:
    config = runner.config
    needed = runner.min_blocks
    if num_blocks < needed:
        missing = (needed - num_blocks) * bytes_per_block
        raise StartupError(
            f"the KV cache ({what}) has {num_blocks} blocks, but one sequence of "
            f"max_model_len={config.max_model_len} tokens needs {needed}: "
            f"{missing / GiB:.3f} GiB ({missing} bytes) of memory are missing; {REMEDY}"
        )


def _out_of_memory(config: EngineConfig, error: BaseException) -> StartupError:
    """A start-up phase ran out of memory: one line with the figures and the remedy."""
    where = ""
    if config.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(config.device)
        where = f" ({free / GiB:.2f} of {total / GiB:.2f} GiB free on {config.device})"
    return StartupError(f"out of memory while starting the engine{where}: {error}; {REMEDY}")


def start_rank(
    config: EngineConfig, group: TPGroup
) -> tuple[ModelRunner, KVCache, MemoryReport, ModelFacts]:
    """What every rank does at start-up: load its shard of the model, then profile,
    size and bind its KV cache (and capture its graphs)."""
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    free_at_start = free_memory_at_start(config)
    try:
        logger.info("Loading %s (%s) on %s.", config.model, config.dtype, config.device)
        model, hf_config = load_model(config.model, config.dtype, config.device, group)
        load_seconds = time.perf_counter() - start
        logger.info("Loaded the weights in %.2f s.", load_seconds)
        if config.device.type == "cpu":  # after loading: its transient buffers go back
            keep_freed_memory(config.cpu_memory_budget_bytes)
        facts = model_facts(hf_config, config.model)
        config.finalize(facts.max_position_embeddings)
        kv_plan = make_kv_cache_plan(model, config)
        # Sleep mode: the weights move where sleep can give them back, before any address
        # of theirs is taken (the profile run, the graphs).
        weights = WeightMemory(model, config.device) if config.enable_sleep_mode else None
        runner = ModelRunner(config, model, kv_plan, facts.vocab_size, group, weights)
        cache, report = initialize_kv_cache(runner, config, free_at_start)
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise _out_of_memory(config, e) from e
    needs_extensible = [
        name
        for name, wanted in (
            ("enable_sleep_mode", config.enable_sleep_mode),
            ("kv_cache_policy='elastic'", config.kv_cache_policy == "elastic"),
        )
        if wanted
    ]
    if needs_extensible and not report.extensible:
        cache.free()
        runner.release()
        raise StartupError(
            f"{' and '.join(needs_extensible)} needs the extensible KV cache, and "
            f"{config.device} has no virtual memory management for it"
        )
    report.load_seconds = load_seconds
    return runner, cache, report, facts


def _smallest(runner: ModelRunner, num_blocks: int, what: str) -> int:
    """The smallest of every rank's block count: all ranks use the driver's block tables."""
    counts = runner.tp.all_gather_ints(num_blocks)
    if len(counts) > 1:
        logger.info("KV blocks %s per rank: %s; every rank uses %d.", what, counts, min(counts))
    return min(counts)


def _measure_graphs(runner: ModelRunner, report: MemoryReport) -> None:
    if not runner.config.enforce_eager:
        logger.info(
            "Capturing the decode graphs%s.",
            "" if runner.use_cuda_graphs else " (the CPU: warm-ups only)",
        )
    report.graph_pool_bytes, report.capture_seconds = _timed(runner.capture_cudagraphs)
    report.graph_pool_bytes_per_rank = runner.tp.all_gather_ints(report.graph_pool_bytes)
    estimate = report.graph_pool_estimate_bytes
    logger.info(
        "Capture took %.2f s; CUDA graphs took %s GiB%s%s.",
        report.capture_seconds,
        ", ".join(f"{b / GiB:.3f}" for b in report.graph_pool_bytes_per_rank),
        f" on ranks 0-{runner.tp.size - 1}" if runner.tp.size > 1 else "",
        "" if estimate is None else f" (estimated {estimate / GiB:.3f} GiB)",
    )


def initialize_kv_cache(
    runner: ModelRunner, config: EngineConfig, free_at_start: int
) -> tuple[KVCache, MemoryReport]:
    """Profile the largest step, size the KV cache from the memory left (extensible or legacy
    flow), allocate and bind it and capture the graphs; return it and the report of how."""
    start = time.perf_counter()
    per_block = runner.kv_plan.bytes_per_block
    profile = runner.profile_run()
    peak = profile.activation_peak_bytes
    profile_seconds = time.perf_counter() - start
    budget, in_use = _memory_in_use(runner, config, free_at_start)
    margin = config.kv_cache_margin_bytes
    if margin is None:
        margin = DEFAULT_CUDA_MARGIN_BYTES if config.device.type == "cuda" else 0
    report = MemoryReport(
        extensible=use_extensible(config),
        block_size=runner.kv_plan.block_size,
        bytes_per_block=per_block,
        weights_bytes=runner.weights_bytes(),
        activation_peak_bytes=peak,
        available_bytes=max(budget - in_use - peak - profile.encoder_cache_bytes, 0),
        margin_bytes=margin,
        encoder_cache_tokens=profile.encoder_cache_tokens,
        encoder_cache_bytes=profile.encoder_cache_bytes,
        encoder_activation_peak_bytes=profile.encoder_activation_peak_bytes,
        profile_seconds=profile_seconds,
    )
    logger.info(
        "Memory profile took %.2f s: budget %.2f GiB, in use %.2f GiB (weights %.2f GiB), "
        "activation peak %.2f GiB, available %.2f GiB.",
        profile_seconds,
        budget / GiB,
        in_use / GiB,
        report.weights_bytes / GiB,
        peak / GiB,
        report.available_bytes / GiB,
    )
    if profile.encoder_cache_bytes:
        logger.info(
            "Encoder cache: %d embeddings (%.3f GiB) kept out of the available memory; the "
            "encoder's activation peak %.3f GiB.",
            report.encoder_cache_tokens,
            report.encoder_cache_bytes / GiB,
            report.encoder_activation_peak_bytes / GiB,
        )
    flow = _extensible_flow if report.extensible else _legacy_flow
    cache, report.num_blocks_committed, report.num_blocks_ceiling = flow(runner, config, report)
    report.num_blocks_capacity = cache.capacity_blocks
    report.kv_cache_bytes = cache.committed_bytes
    report.kv_reserved_bytes = cache.reserved_bytes
    report.kv_bytes_by_kind = cache.bytes_by_kind()
    report.kv_cache_groups = runner.kv_plan.group_sizing(
        config.max_model_len, config.max_num_batched_tokens
    )
    _log_groups(report, config.max_model_len)
    runner.hold_activation_memory()
    report.kv_setup_seconds = time.perf_counter() - start
    sizing = report.kv_setup_seconds - report.profile_seconds - report.capture_seconds
    logger.info(
        "KV cache setup took %.2f s (profile %.2f s, capture %.2f s, sizing %.2f s of which "
        "extend %.2f s): %d blocks.",
        report.kv_setup_seconds,
        report.profile_seconds,
        report.capture_seconds,
        sizing,
        report.extend_seconds,
        report.num_blocks_committed,
    )
    return cache, report


def _log_groups(report: MemoryReport, max_model_len: int) -> None:
    """One line per KV cache group: what it keeps and what a long sequence takes of the pool."""
    groups = report.kv_cache_groups
    logger.info(
        "KV cache: %d blocks of %d bytes (%d tokens each), shared by %d group(s).",
        report.num_blocks_committed,
        report.bytes_per_block,
        report.block_size,
        len(groups),
    )
    for index, group in enumerate(groups):
        layers = group["layers"]
        names = ", ".join(layers) if len(layers) <= 3 else f"{layers[0]}, ..., {layers[-1]}"
        logger.info(
            "KV cache group %d: %s, %d layer(s) (%s), %d-byte pages; a %d-token sequence "
            "holds at most %d of its blocks (%.3f GiB).",
            index,
            group["kind"],
            len(layers),
            names,
            group["page_size_bytes"],
            max_model_len,
            group["max_blocks_per_seq"],
            group["max_bytes_per_seq"] / GiB,
        )


def _allocate(
    runner: ModelRunner, config: EngineConfig, num_blocks: int, extensible: bool
) -> KVCache:
    plan = runner.kv_plan
    cache = KVCache(plan.buffers(num_blocks), plan.layouts, config.device, extensible=extensible)
    runner.bind_kv_cache(cache)
    return cache


def _extensible_flow(
    runner: ModelRunner, config: EngineConfig, report: MemoryReport
) -> tuple[KVCache, int, int]:
    per_block = report.bytes_per_block
    capacity = max(report.available_bytes // per_block, config.num_gpu_blocks_override or 0)
    if capacity < 1:
        _check_fits(0, runner, per_block, "nothing available after the profiling run")
    cache = _allocate(runner, config, capacity, extensible=True)
    logger.info(
        "Reserved address space for %d KV blocks (%.2f GiB); committed %d block(s).",
        capacity,
        cache.reserved_bytes / GiB,
        cache.num_blocks,
    )
    _measure_graphs(runner, report)
    final_bytes = max(
        report.available_bytes
        - report.graph_pool_bytes
        - report.margin_bytes
        - cache.commit_rounding_bytes,
        0,
    )
    num_blocks = config.num_gpu_blocks_override or min(final_bytes // per_block, capacity)
    num_blocks = _smallest(runner, num_blocks, "sized after graph capture")
    _check_fits(num_blocks, runner, per_block, "sized after graph capture")
    ceiling = num_blocks
    if config.kv_cache_policy == "elastic":  # the rest is committed on demand
        floor = floor_blocks(cache, runner.min_blocks, ceiling)
        num_blocks = _smallest(runner, floor, "the elastic policy's floor")
    num_blocks, report.extend_seconds = _timed(lambda: cache.extend(num_blocks))
    num_blocks = _smallest(runner, num_blocks, "committed")
    _check_fits(num_blocks, runner, per_block, "extended as far as physical memory allowed")
    return cache, num_blocks, num_blocks if config.kv_cache_policy == "static" else ceiling


def _legacy_flow(
    runner: ModelRunner, config: EngineConfig, report: MemoryReport
) -> tuple[KVCache, int, int]:
    per_block = report.bytes_per_block
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // per_block
    else:
        report.graph_pool_estimate_bytes = estimate_graph_memory(runner, config)
        kv_bytes = report.available_bytes - report.graph_pool_estimate_bytes - report.margin_bytes
        num_blocks = max(kv_bytes, 0) // per_block
    num_blocks = _smallest(runner, num_blocks, "sized before graph capture")
    _check_fits(num_blocks, runner, per_block, "sized before graph capture")
    cache = _allocate(runner, config, num_blocks, extensible=False)
    logger.info(
        "Allocated KV cache of %d blocks (%.2f GiB).", num_blocks, cache.committed_bytes / GiB
    )
    _measure_graphs(runner, report)
    return cache, num_blocks, num_blocks


def estimate_graph_memory(runner: ModelRunner, config: EngineConfig) -> int:
    """What the legacy path must guess before its KV cache exists: against a one-block
    throwaway cache, capture the largest decode graph, then the two smallest beside
    it, and extrapolate their mean increment to every other size."""
    if not runner.use_cuda_graphs:
        return 0
    sizes = decode_batch_sizes(config.max_num_seqs)
    probe = [sizes[-1], *sizes[:2]][: len(sizes)]
    scratch = _allocate(runner, config, 1, extensible=False)
    try:
        largest = runner.capture_cudagraphs(probe[:1])
        runner.release_cudagraphs()
        several = runner.capture_cudagraphs(probe)
        runner.release_cudagraphs()
    finally:
        scratch.free()
    if len(probe) == 1:
        return largest
    per_graph = max(several - largest, 0) / (len(probe) - 1)
    return int(largest + per_graph * (len(sizes) - 1))
