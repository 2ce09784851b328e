"""Attention backends behind one interface; `create_backend` picks one by name."""
from __future__ import annotations

from typing import TYPE_CHECKING

from rollout.errors import ConfigError

if TYPE_CHECKING:
    from rollout.attention.base import AttentionBackend
    from rollout.model_runner import ModelRunner


def resolve_backend_name(name: str, device: str) -> str:
    if name != "auto":
        return name
    if not device.startswith("cuda"):
        return "torch_native"
    try:
        import flashinfer  # noqa: F401
        return "flashinfer"
    except ImportError:
        return "triton"


def create_backend(name: str, runner: "ModelRunner") -> "AttentionBackend":
    name = resolve_backend_name(name, runner.device.type)
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
