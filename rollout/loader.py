"""Checkpoint loading for the engine: the safetensors reader of weight_sync.checkpoint with
CheckpointError as its error type (a broken model directory is a checkpoint problem here)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from rollout.errors import CheckpointError
from weight_sync import checkpoint
from weight_sync.spec import TensorSpec

INDEX_NAME = checkpoint.INDEX_NAME


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    return checkpoint.checkpoint_files(model_dir, CheckpointError)


def read_specs(files: list[Path]) -> list[TensorSpec]:
    return checkpoint.read_specs(files, CheckpointError)


def iter_slices(files: list[Path], names: Optional[set[str]] = None):
    """(HF name, lazy slice) pairs: each TP rank's weight loader reads only its part."""
    return checkpoint.iter_slices(files, names)
