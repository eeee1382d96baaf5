"""extkv: an LLM inference engine with a KV cache sized after CUDA-graph capture."""

from extkv.vmm import ExtensibleTensor

__all__ = ["LLM", "ExtensibleTensor", "Logprob", "SamplingParams"]


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
