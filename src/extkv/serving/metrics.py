"""Prometheus metrics of one server.

Each server has a registry of its own, so several in one process never collide.
Only the engine thread writes them (prometheus-client is thread-safe); `/metrics`
renders whatever the last loop iteration left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from extkv.engine.llm_engine import LLMEngine

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.kv_blocks = Gauge("extkv_kv_cache_blocks", "KV cache blocks in all", registry=r)
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

    def update_engine(self, engine: LLMEngine) -> None:
        """Copy the engine's state into the gauges (engine thread only)."""
        self.kv_blocks.set(engine.block_manager.num_blocks)
        self.kv_blocks_used.set(engine.block_manager.num_used_blocks)
        self.kv_reserved_bytes.set(engine.kv_cache.reserved_bytes)
        self.kv_committed_bytes.set(engine.kv_cache.committed_bytes)
        self.graph_pool_bytes.set(engine.report.graph_pool_bytes)
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))

    def render(self) -> bytes:
        return generate_latest(self.registry)
