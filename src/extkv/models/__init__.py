"""Model implementations and the Hugging Face checkpoint loader."""

from extkv.models.config import ModelFacts, model_facts
from extkv.models.llama import LlamaForCausalLM
from extkv.models.loader import MODEL_REGISTRY, load_model
from extkv.models.qwen3 import Qwen3ForCausalLM

__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "ModelFacts",
    "Qwen3ForCausalLM",
    "load_model",
    "model_facts",
]
