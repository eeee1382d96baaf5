"""Every engine option, declared once: `LLM(**options)` and the command line's flags are
generated from these fields (see `extkv.options`)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from extkv.engine.multimodal import check_limit_mm_per_prompt
from extkv.models.hf_config import resolve_model
from extkv.options import Bool, Choice, Custom, Float, Int, check_options, option, required
from extkv.vmm import resolve_device

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
KV_LAYOUTS = ("split", "block_major")
DEFAULT_MAX_MODEL_LEN = 8192  # for models without max_position_embeddings (pure Mamba)
DEFAULT_STEP_TOKENS = 8192  # max_num_batched_tokens on CUDA
DEFAULT_CPU_STEP_TOKENS = 2048  # and on the CPU
KV_CACHE_POLICIES = ("static", "elastic")


def _resolve_engine_device(device: object) -> torch.device:
    """None picks CUDA when there is one; anything else as ExtensibleTensor takes it. A
    CUDA device always gets its index (the current device for a bare "cuda"): the engine's
    threads and workers select it by index, and torch's set_device refuses one without."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} asks for CUDA, but no CUDA device is visible; pass "
            "device='cpu' (--device cpu on the command line) to run on the CPU"
        )
    resolved = resolve_device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def _resolve_dtype(dtype: object) -> torch.dtype | None:
    """None: chosen by the device (bfloat16 on CUDA, float32 on the CPU)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in _DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (or the torch dtype); got {dtype!r}")


def _model_source(model: object) -> str:
    if not isinstance(model, str | os.PathLike):
        raise ValueError(f"model must be a folder, a .gguf file or a hub id; got {model!r}")
    try:
        resolve_model(model)
    except (OSError, ImportError, ValueError) as e:
        raise ValueError(str(e)) from None
    return os.fspath(model)


def _media_folder(path: object) -> str | None:
    """None, or an existing folder, made absolute with its links resolved."""
    if path is None:
        return None
    if not isinstance(path, str | os.PathLike) or not os.path.isdir(path):
        raise ValueError(f"allowed_local_media_path must be an existing folder; got {path!r}")
    return os.path.realpath(path)


def _media_domains(value: object) -> tuple[str, ...] | None:
    """None, or host names (a list, or one string of them split by commas or spaces),
    lowercased."""
    if value is None:
        return None
    names = value.replace(",", " ").split() if isinstance(value, str) else value
    if (
        not isinstance(names, list | tuple)
        or not names
        or not all(isinstance(n, str) and n and "/" not in n and ":" not in n for n in names)
    ):
        raise ValueError(
            "allowed_media_domains must be None or a non-empty list of host names (e.g. "
            f"['upload.wikimedia.org']); got {value!r}"
        )
    return tuple(n.lower() for n in names)


@dataclass
class EngineConfig:
    """What `LLM(...)` accepts (the same names as vLLM's where vLLM has the option)."""

    model: str = required(
        "Hugging Face checkpoint folder (config.json + safetensors), .gguf file or hub id",
        Custom(_model_source, "a checkpoint folder, a .gguf file or a hub id", "MODEL"),
    )
    device: str | int | torch.device | None = option(
        None,
        "cpu, cuda or cuda:N; None: cuda if there is one",
        Custom(_resolve_engine_device, "cpu, cuda, cuda:N or None", "DEVICE"),
    )
    dtype: str | torch.dtype | None = option(
        None,
        "model dtype; None: bfloat16 on CUDA, float32 on the CPU",
        Custom(_resolve_dtype, f"one of {', '.join(_DTYPES)}", "DTYPE"),
    )
    enable_extensible_kv_cache: bool | Literal["auto"] = option(
        False,
        "size the KV cache after CUDA-graph capture from the memory really left; 'auto': "
        "where the device has virtual memory management",
        Choice((True, False, "auto")),
    )
    gpu_memory_utilization: float = option(
        0.9, "share of the GPU's memory the engine may use", Float(0, 1, above_minimum=True)
    )
    kv_cache_memory_bytes: int | None = option(
        None, "KV cache size (legacy path only)", Int(0, optional=True)
    )
    num_gpu_blocks_override: int | None = option(
        None, "fix the KV cache's block count", Int(0, optional=True)
    )
    block_size: int = option(16, "tokens per KV cache block", Choice((8, 16, 32, 64, 128, 256)))
    max_model_len: int | None = option(
        None, "longest sequence, prompt + output; None: the model's", Int(1, optional=True)
    )
    max_num_seqs: int = option(256, "most sequences in one batch", Int(1))
    max_num_batched_tokens: int | None = option(
        None,
        "most tokens in one step (longer prompts are prefilled in chunks); None: "
        "max(8192, max_num_seqs) on CUDA, max(2048, max_num_seqs) on the CPU",
        Int(1, optional=True),
    )
    enforce_eager: bool = option(False, "no CUDA graphs", Bool())
    kv_layout: str = option("split", "how K and V of a block are laid out", Choice(KV_LAYOUTS))
    attention_backend: str | None = option(
        None, "deprecated alias of kv_layout", Choice(KV_LAYOUTS, optional=True)
    )
    seed: int = option(0, "seed of the sampling of requests without a seed", Int(0))
    cpu_memory_budget_bytes: int = option(
        2 << 30, "memory the engine may use on the CPU (weights, activations, KV)", Int(1)
    )
    kv_cache_margin_bytes: int | None = option(
        None,
        "memory the extensible sizing keeps free; None: 256 MiB on CUDA, 0 on the CPU",
        Int(0, optional=True),
    )
    tensor_parallel_size: int = option(
        1, "ranks to split the model over (worker processes; one GPU each on CUDA)", Int(1)
    )
    enable_prefix_caching: bool = option(
        False, "reuse the KV of prompt prefixes already computed", Bool()
    )
    async_scheduling: bool | None = option(
        None,
        "plan each step while the device runs the one before; None: on unless "
        "tensor_parallel_size > 1",
        Bool(optional=True),
    )
    enable_sleep_mode: bool = option(
        False,
        "allow sleep() and wake_up() (the server's /sleep, /wake_up, /is_sleeping): the "
        "weights and the KV cache live in virtual memory that sleep gives back and wake maps "
        "again under the same addresses; needs the extensible KV cache",
        Bool(),
    )
    kv_cache_policy: str = option(
        "static",
        "static: the KV cache commits all the memory it is sized for at start-up; elastic: it "
        "commits enough for one max_model_len sequence, grows by granules when requests would "
        "wait or be preempted (up to that size) and gives idle memory back; needs the "
        "extensible KV cache",
        Choice(KV_CACHE_POLICIES),
    )
    kv_idle_release_s: float = option(
        30.0,
        "elastic policy: seconds KV cache blocks stay unused before their memory goes back",
        Float(0, above_minimum=True),
    )
    limit_mm_per_prompt: dict[str, int] | None = option(
        None,
        "most images one prompt may carry, as {'image': N} (command line: image=N); None: "
        "as many as max_model_len holds",
        Custom(check_limit_mm_per_prompt, "image=N with N an int >= 0", "image=N"),
    )
    allowed_local_media_path: str | None = option(
        None,
        "a folder whose image files chat messages may name as file:// URLs (None: no local files)",
        Custom(_media_folder, "an existing folder", "FOLDER"),
    )
    allowed_media_domains: tuple[str, ...] | None = option(
        None,
        "hosts whose http(s):// image URLs chat messages may name, redirects included "
        "(None: no remote images)",
        Custom(_media_domains, "host names, comma-separated", "HOST[,HOST...]"),
    )
    worker_heartbeat_timeout: float = option(
        30.0,
        "seconds a tensor-parallel worker may go silent before the engine gives it up",
        Float(0, above_minimum=True),
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.dtype is None:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.attention_backend is not None:
            warnings.warn(
                "attention_backend is deprecated and will be removed; use kv_layout",
                DeprecationWarning,
                stacklevel=4,
            )
            self.kv_layout, self.attention_backend = self.attention_backend, None
        if self.enable_extensible_kv_cache is True and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                "kv_cache_memory_bytes cannot be combined with enable_extensible_kv_cache: "
                "the extensible KV cache sizes itself from the memory left after capture"
            )
        if self.enable_sleep_mode and self.enable_extensible_kv_cache is False:
            raise ValueError(
                "enable_sleep_mode needs enable_extensible_kv_cache=True (or 'auto'): sleep "
                "gives back the KV cache's memory under addresses the CUDA graphs keep"
            )
        if self.kv_cache_policy == "elastic" and self.enable_extensible_kv_cache is False:
            raise ValueError(
                "kv_cache_policy='elastic' needs enable_extensible_kv_cache=True (or 'auto'): it "
                "grows and shrinks the KV cache under addresses the CUDA graphs keep"
            )
        if self.async_scheduling is None:
            self.async_scheduling = self.tensor_parallel_size == 1
        elif self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling=True needs tensor_parallel_size=1: the workers take each "
                "step's input tokens from the host, which async scheduling has not got yet"
            )
        if (
            self.device.type == "cuda"
            and self.device.index + self.tensor_parallel_size > torch.cuda.device_count()
        ):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs one CUDA device "
                f"per rank from {self.device} on; {torch.cuda.device_count()} are visible"
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
            # On the CPU a step of 2048 tokens already keeps the matmuls busy; more only
            # makes the start-up profile (one step of this many tokens) slower.
            step = DEFAULT_STEP_TOKENS if self.device.type == "cuda" else DEFAULT_CPU_STEP_TOKENS
            self.max_num_batched_tokens = max(step, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with `changes`, checked again as a new config would be."""
        return dataclasses.replace(self, **changes)

    def for_rank(self, rank: int) -> EngineConfig:
        """The config of tensor-parallel rank `rank`: on CUDA, the rank-th device from ours."""
        if self.device.type != "cuda":
            return self
        return self.replace(device=torch.device("cuda", self.device.index + rank))
