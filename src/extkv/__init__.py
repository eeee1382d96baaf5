"""extkv: an LLM inference engine with a KV cache sized after CUDA-graph capture."""

from extkv.vmm import ExtensibleTensor

__all__ = ["ExtensibleTensor"]
