"""Qwen2 and Qwen3: the Llama-style decoder, with biases on q, k and v (Qwen2) or RMSNorm on
every q and k head before RoPE (Qwen3)."""

from __future__ import annotations

from typing import ClassVar

from extkv.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama network with biases on the q, k and v projections (not on o)."""

    qkv_bias: ClassVar[bool | None] = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: the Llama network with per-head q/k RMSNorm turned on."""

    qk_norm: ClassVar[bool] = True
