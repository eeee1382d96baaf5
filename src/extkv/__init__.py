"""extkv: an LLM inference engine with a KV cache sized after CUDA-graph capture."""

from extkv.vmm import ExtensibleTensor

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)
__all__ = ["LLM", "ExtensibleTensor", "Logprob", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # The engine pulls in transformers; import it only when asked for.
    if name == "LLM":
        from extkv.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from extkv.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "Logprob":
        from extkv.engine.outputs import Logprob

        return Logprob
    raise AttributeError(f"module 'extkv' has no attribute {name!r}")
