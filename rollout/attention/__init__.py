"""Attention backends behind one interface; `create_backend` picks one by name."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from rollout.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from rollout.attention.base import AttentionBackend
    from rollout.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_backend_name(name: str, device: str, dtype: Optional["torch.dtype"] = None,
                         head_dim: Optional[int] = None) -> str:
    """The backend that "auto" stands for: torch_native off CUDA; on CUDA flashinfer when it
    imports and serves this dtype and head_dim (where given), else triton."""
    if name != "auto":
        return name
    if not device.startswith("cuda"):
        return "torch_native"
    from rollout.attention.flashinfer_backend import flashinfer_importable, unsupported_reason
    if unsupported_reason(dtype, head_dim) is not None:
        return "triton"
    try:
        return "flashinfer" if flashinfer_importable() else "triton"
    except Exception as e:  # installed but broken (a native library missing, say)
        logger.warning("flashinfer is installed but failed to import (%s); using triton", e)
        return "triton"


def create_backend(name: str, runner: "ModelRunner") -> "AttentionBackend":
    name = resolve_backend_name(name, runner.device.type, runner.dtype, runner.model_config.head_dim)
    if name == "torch_native":
        from rollout.attention.torch_native import TorchNativeBackend
        return TorchNativeBackend(runner)
    if name == "triton":
        from rollout.attention.triton_backend import TritonBackend
        return TritonBackend(runner)
    if name == "flashinfer":
        from rollout.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(runner)
    raise ConfigError(f"unknown attention backend {name!r}")
