"""Typed errors. Each one says what was wrong and, where it helps, what to do about it."""
from weight_sync.errors import WeightUpdateError  # noqa: F401  (re-exported: rollout.WeightUpdateError)


class RolloutError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(RolloutError, ValueError):
    """An EngineConfig/ModelConfig value or a model directory's config.json is invalid."""


class CheckpointError(RolloutError):
    """A checkpoint is missing, malformed, or does not match the model's parameter table."""


class InvalidRequestError(RolloutError, ValueError):
    """A generate() call or its SamplingParams are invalid. Raised before any work starts."""


class KVCacheBudgetError(RolloutError):
    """The KV cache cannot hold even one request of the asked size."""


class EngineNotReadyError(RolloutError):
    """The engine refuses to generate: weights are incomplete or memory is released."""


class DistributedInitError(RolloutError):
    """A tensor-parallel process group could not be set up (rendezvous timed out or failed)."""
