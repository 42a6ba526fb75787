"""Model registry: Hugging Face `config.architectures` name -> our paged-attention implementation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from batchinfer.engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3, SmolLM2
    "Qwen2ForCausalLM": LlamaForCausalLM,  # qkv bias
    "MistralForCausalLM": LlamaForCausalLM,  # sliding window only when max_model_len exceeds it (rejected)
}


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The implementation for a config's `architectures`, or a ValueError listing the supported ones."""
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"model architecture {architectures or '(config.json has no architectures field)'} is not supported; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
