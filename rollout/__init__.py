"""rollout: the engine core (no Ray). Public API: Engine, EngineConfig, SamplingParams, GenerateOutput."""
from rollout.config import EngineConfig, ModelConfig
from rollout.engine import Engine
from rollout.errors import (CheckpointError, ConfigError, DistributedInitError, EngineNotReadyError,
                            InvalidRequestError, KVCacheBudgetError, RolloutError, WeightUpdateError)
from rollout.outputs import GenerateOutput
from rollout.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "ModelConfig", "SamplingParams", "GenerateOutput",
           "RolloutError", "ConfigError", "CheckpointError", "InvalidRequestError",
           "KVCacheBudgetError", "WeightUpdateError", "EngineNotReadyError", "DistributedInitError"]
