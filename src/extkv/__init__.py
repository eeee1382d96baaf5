"""extkv: an LLM inference engine with a KV cache sized after CUDA-graph capture."""

import importlib

from extkv.vmm import ExtensibleTensor

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)
__all__ = [
    "LLM",
    "ExtensibleTensor",
    "Logprob",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
# The engine pulls in transformers: these names are imported from their modules only
# when asked for.
_LAZY = {
    "LLM": "extkv.engine.llm",
    "SamplingParams": "extkv.engine.sampling_params",
    "RequestOutputKind": "extkv.engine.sampling_params",
    "Logprob": "extkv.engine.outputs",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'extkv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
