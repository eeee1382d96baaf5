"""Model implementations and the Hugging Face checkpoint loader."""

from extkv.models.bamba import BambaForCausalLM
from extkv.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from extkv.models.gemma3 import Gemma3ForCausalLM
from extkv.models.gemma3_mm import Gemma3ForConditionalGeneration
from extkv.models.hf_config import ModelFacts, model_facts
from extkv.models.llama import LlamaForCausalLM, MistralForCausalLM
from extkv.models.llava import LlavaForConditionalGeneration
from extkv.models.loader import MODEL_REGISTRY, check_tensor_parallel, load_model
from extkv.models.mamba2 import Mamba2Mixer
from extkv.models.mamba2_model import Mamba2ForCausalLM
from extkv.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM
from extkv.models.qwen3_moe import Qwen3MoeForCausalLM
from extkv.models.vision_language import ImageSpec

__all__ = [
    "MODEL_REGISTRY",
    "BambaForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "ImageSpec",
    "LlamaForCausalLM",
    "LlavaForConditionalGeneration",
    "Mamba2ForCausalLM",
    "Mamba2Mixer",
    "MistralForCausalLM",
    "ModelFacts",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "check_tensor_parallel",
    "load_model",
    "model_facts",
]
