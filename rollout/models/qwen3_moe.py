"""Qwen3-MoE: Qwen3's decoder (q/k norms) with sparse mixture-of-experts MLPs (`layers.moe`) in
the layers its config names; checkpoints and weight sync take both HF namings of the experts."""
from __future__ import annotations

from rollout.config import ModelConfig
from rollout.distributed import SINGLE, TPGroup
from rollout.errors import ConfigError
from rollout.models.llama import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        if cfg.moe is None:
            raise ConfigError("Qwen3MoeForCausalLM: config.json has no num_experts")
        super().__init__(cfg, tp)
