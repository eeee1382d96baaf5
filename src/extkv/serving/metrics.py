"""Prometheus metrics of one server.

Each server has a registry of its own, so several in one process never collide.
Only the engine thread writes them (prometheus-client is thread-safe); `/metrics`
renders whatever the last loop iteration left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from extkv.engine.stats import EngineStats

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    """The server's Prometheus metrics: engine gauges from `EngineStats`, request counters
    and latency histograms from the engine thread."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.kv_blocks = Gauge(
            "extkv_kv_cache_blocks", "KV cache blocks committed (usable now)", registry=r
        )
        self.kv_blocks_capacity = Gauge(
            "extkv_kv_cache_blocks_capacity", "KV cache blocks the reserved space holds", registry=r
        )
        self.kv_blocks_used = Gauge(
            "extkv_kv_cache_blocks_used", "KV cache blocks held by requests", registry=r
        )
        self.kv_reserved_bytes = Gauge(
            "extkv_kv_cache_reserved_bytes", "virtual address space reserved", registry=r
        )
        self.kv_committed_bytes = Gauge(
            "extkv_kv_cache_committed_bytes", "physical memory committed", registry=r
        )
        self.graph_pool_bytes = Gauge(
            "extkv_graph_pool_bytes", "memory the CUDA-graph capture took", registry=r
        )
        self.running = Gauge("extkv_requests_running", "requests being decoded", registry=r)
        self.waiting = Gauge("extkv_requests_waiting", "requests not yet scheduled", registry=r)
        self.preemptions = Gauge(
            "extkv_preemptions", "requests preempted (recomputed) since start", registry=r
        )
        self.kv_resizes = Gauge(
            "extkv_kv_cache_resizes",
            "KV cache resizes while serving, since start, by direction",
            ["direction"],
            registry=r,
        )
        self.sleep_level = Gauge(
            "extkv_sleep_level", "sleep mode: 0 awake, else the level slept at", registry=r
        )
        self.encoder_cache_tokens = Gauge(
            "extkv_encoder_cache_tokens",
            "image embeddings the encoder cache holds at most (0: a model without images)",
            registry=r,
        )
        self.encoder_cache_used_tokens = Gauge(
            "extkv_encoder_cache_used_tokens",
            "image embeddings in the encoder cache now",
            registry=r,
        )
        self.encoder_cache_hits = Gauge(
            "extkv_encoder_cache_hits",
            "images found in the encoder cache since start (not encoded again)",
            registry=r,
        )
        self.encoder_cache_misses = Gauge(
            "extkv_encoder_cache_misses", "images encoded since start", registry=r
        )
        self.prompt_tokens = Counter("extkv_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("extkv_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter(
            "extkv_requests_finished", "requests ended, by reason", ["reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            "extkv_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "extkv_inter_token_latency_seconds",
            "time between two tokens of one request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )

    def update_engine(self, stats: EngineStats) -> None:
        """Copy a snapshot of the engine (`LLMEngine.stats()`) into the gauges."""
        self.kv_blocks.set(stats.num_blocks_committed)
        self.kv_blocks_capacity.set(stats.num_blocks_capacity)
        self.kv_blocks_used.set(stats.num_blocks_used)
        self.kv_reserved_bytes.set(stats.kv_reserved_bytes)
        self.kv_committed_bytes.set(stats.kv_committed_bytes)
        self.graph_pool_bytes.set(stats.graph_pool_bytes)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.preemptions.set(stats.num_preemptions)
        self.kv_resizes.labels("grow").set(stats.num_kv_grows)
        self.kv_resizes.labels("shrink").set(stats.num_kv_shrinks)
        self.sleep_level.set(stats.sleep_level)
        self.encoder_cache_tokens.set(stats.encoder_cache_tokens)
        self.encoder_cache_used_tokens.set(stats.encoder_cache_used_tokens)
        self.encoder_cache_hits.set(stats.encoder_cache_hits)
        self.encoder_cache_misses.set(stats.encoder_cache_misses)

    def render(self) -> bytes:
        """The registry in Prometheus's text format, for `/metrics`."""
        return generate_latest(self.registry)
