"""Architecture name (config.json `architectures[0]`) → model class. One line per model."""
from __future__ import annotations

from torch import nn

from rollout.errors import ConfigError
from rollout.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                  Qwen3ForCausalLM)
from rollout.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ConfigError(f"unknown architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]
