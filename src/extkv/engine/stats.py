"""What the engine publishes about itself: one snapshot type, so readers (the server's
metrics, benchmarks) never reach into the scheduler, the block manager or the cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A point-in-time view of the engine (`LLMEngine.stats()`)."""

    num_blocks_committed: int  # blocks the pool hands out
    num_blocks_capacity: int  # blocks the reserved address space holds
    num_blocks_used: int  # held by requests now
    kv_reserved_bytes: int
    kv_committed_bytes: int
    graph_pool_bytes: int
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start
    num_cached_prompt_tokens: int  # prompt tokens served by prefix caching, since start
    num_steps: int  # steps launched, since start
    num_kv_grows: int = 0  # KV cache resizes while serving, since start
    num_kv_shrinks: int = 0
    sleep_level: int = 0  # 0: awake
    # Vision-language models: the encoder cache's budget and what it holds (embeddings,
    # entries), and since start the images found in it (hits) and encoded (misses).
    encoder_cache_tokens: int = 0
    encoder_cache_used_tokens: int = 0
    encoder_cache_entries: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
