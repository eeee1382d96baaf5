"""Every engine option in one validated place, shared by `LLM` and the command line."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

import torch

from extkv.vmm import resolve_device

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
ENGINE_BACKENDS = ("split", "block_major")
DEFAULT_CPU_MEMORY_BUDGET = 2 << 30
DEFAULT_MAX_MODEL_LEN = 8192  # for models without max_position_embeddings (pure Mamba)


@dataclass
class EngineConfig:
    """What `LLM(...)` accepts; see README for each option's meaning."""

    model: str
    device: str | int | torch.device | None = None
    dtype: str | torch.dtype | None = None
    enable_extensible_kv_cache: bool | Literal["auto"] = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    attention_backend: str = "split"
    seed: int = 0
    cpu_memory_budget_bytes: int = DEFAULT_CPU_MEMORY_BUDGET
    kv_cache_margin_bytes: int | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = False
    async_scheduling: bool | None = None  # None: on unless tensor_parallel_size > 1

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(str(self.model), "config.json")):
            raise ValueError(
                f"model must be a checkpoint folder holding config.json; got {self.model!r}"
            )
        self.device = _resolve_engine_device(self.device)
        self.dtype = _resolve_dtype(self.dtype, self.device)
        if self.enable_extensible_kv_cache not in (True, False, "auto"):
            raise ValueError(
                "enable_extensible_kv_cache must be True, False or 'auto'; "
                f"got {self.enable_extensible_kv_cache!r}"
            )
        if self.enable_extensible_kv_cache is True and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                "kv_cache_memory_bytes cannot be combined with enable_extensible_kv_cache: "
                "the extensible KV cache sizes itself from the memory left after capture"
            )
        if not isinstance(self.gpu_memory_utilization, float | int) or not (
            0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization!r}"
            )
        for name in ("kv_cache_memory_bytes", "num_gpu_blocks_override", "kv_cache_margin_bytes"):
            _check_int(name, getattr(self, name), minimum=0, optional=True)
        if self.block_size not in _BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {_BLOCK_SIZES}; got {self.block_size!r}")
        _check_int("max_model_len", self.max_model_len, minimum=1, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1, optional=True)
        _check_int("seed", self.seed, minimum=0)
        _check_int("cpu_memory_budget_bytes", self.cpu_memory_budget_bytes, minimum=1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False; got {self.enable_prefix_caching!r}"
            )
        if self.async_scheduling not in (True, False, None):
            raise ValueError(
                f"async_scheduling must be True, False or None; got {self.async_scheduling!r}"
            )
        if self.async_scheduling is None:
            self.async_scheduling = self.tensor_parallel_size == 1
        elif self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling=True needs tensor_parallel_size=1: the workers take each "
                "step's input tokens from the host, which async scheduling has not got yet"
            )
        if self.device.type == "cuda" and self.tensor_parallel_size > 1:
            first = self.device.index
            self.device = torch.device(
                "cuda", torch.cuda.current_device() if first is None else first
            )
            if self.device.index + self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} needs one CUDA device "
                    f"per rank from {self.device} on; {torch.cuda.device_count()} are visible"
                )
        if self.attention_backend not in ENGINE_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ENGINE_BACKENDS}; "
                f"got {self.attention_backend!r}"
            )

    def finalize(self, max_position_embeddings: int | None) -> None:
        """Fill the defaults that depend on the model (None: it has no position limit)."""
        if self.max_model_len is None:
            self.max_model_len = max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        elif max_position_embeddings is not None and self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({max_position_embeddings})"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(8192, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def for_rank(self, rank: int) -> EngineConfig:
        """The config of tensor-parallel rank `rank`: on CUDA, the rank-th device from ours."""
        if self.device.type != "cuda":
            return self
        return self.replace(device=torch.device("cuda", self.device.index + rank))


def _check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        suffix = " or None" if optional else ""
        raise ValueError(f"{name} must be an int >= {minimum}{suffix}; got {value!r}")


def _resolve_engine_device(device: object) -> torch.device:
    """None picks CUDA when there is one; anything else as ExtensibleTensor takes it."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_device(device)


def _resolve_dtype(dtype: object, device: torch.device) -> torch.dtype:
    """None: bfloat16 on CUDA, float32 on the CPU."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (or the torch dtype); got {dtype!r}")
