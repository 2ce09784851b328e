"""Hugging Face safetensors checkpoints: single file or sharded with an index. Never pickle.

Headers are read first so a checkpoint is validated before any weight is copied; tensors then
stream as lazy slices, so a TP rank reads only its part. Used for the initial load (errors are
CheckpointErrors there) and for disk weight updates (WeightUpdateErrors)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from weight_sync.disk import SAFETENSORS_DTYPES, iter_lazy
from weight_sync.errors import WeightUpdateError
from weight_sync.spec import TensorSpec

_ST_DTYPES = {**SAFETENSORS_DTYPES, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path, error: type[Exception] = WeightUpdateError) -> list[Path]:
    """The safetensors files of a HF model directory, in a stable order."""
    d = Path(model_dir)
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    if (d / INDEX_NAME).is_file():
        return _files_from_index(d, error)
    loose = sorted(d.glob("*.safetensors"))
    if loose:
        return loose
    pickles = [n for n in _PICKLE_NAMES if (d / n).exists()] + [p.name for p in d.glob("*.bin")]
    if pickles:
        raise error(
            f"{d} holds only pickle checkpoints ({pickles[0]}); they can run arbitrary code when "
            "loaded and are refused. Convert with `model.save_pretrained(dir, safe_serialization=True)`")
    raise error(f"no model.safetensors or {INDEX_NAME} in {d}")


def _files_from_index(d: Path, error: type[Exception]) -> list[Path]:
    try:
        weight_map = json.loads((d / INDEX_NAME).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise error(f"{d / INDEX_NAME} is malformed: {e}") from None
    files = sorted({d / f for f in weight_map.values()})
    for f in files:
        if not f.is_file():
            raise error(f"shard {f.name} named in {INDEX_NAME} is missing from {d}")
    return files


def read_specs(files: list[Path], error: type[Exception] = WeightUpdateError) -> list[TensorSpec]:
    """Names, shapes and dtypes from the safetensors headers (no tensor data is read)."""
    specs = []
    for f in files:
        with _open(f, error) as st:
            for name in st.keys():
                sl = st.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise error(f"{f.name}: tensor {name!r} has unsupported dtype {sl.get_dtype()}")
                specs.append(TensorSpec(name, tuple(sl.get_shape()), dtype))
    return specs


def iter_slices(files: list[Path], names: Optional[set[str]] = None):
    """(name, lazy slice) pairs: each TP rank's weight loader reads only its part."""
    return iter_lazy(files, names)


def _open(path: Path, error: type[Exception] = WeightUpdateError):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise error(f"{path.name} is not a readable safetensors file: {e}") from None
