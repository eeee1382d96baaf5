"""Qwen3: the Llama-style decoder with RMSNorm on every q and k head before RoPE."""

from __future__ import annotations

from typing import ClassVar

from extkv.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: the Llama network with per-head q/k RMSNorm turned on."""

    qk_norm: ClassVar[bool] = True
