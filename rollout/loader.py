"""Hugging Face safetensors checkpoints: single file or sharded with an index. Never pickle.

Headers are read first so a checkpoint is validated against the model before any weight is
copied; tensors then stream one at a time (`get_slice` lets a TP rank read only its part)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from rollout.errors import CheckpointError
from weight_sync.spec import TensorSpec

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a HF model directory, in a stable order."""
    d = Path(model_dir)
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    if (d / INDEX_NAME).is_file():
        return _files_from_index(d)
    loose = sorted(d.glob("*.safetensors"))
    if loose:
        return loose
    pickles = [n for n in _PICKLE_NAMES if (d / n).exists()] + [p.name for p in d.glob("*.bin")]
    if pickles:
        raise CheckpointError(
            f"{d} holds only pickle checkpoints ({pickles[0]}); they can run arbitrary code when "
            "loaded and are refused. Convert with `model.save_pretrained(dir, safe_serialization=True)`")
    raise CheckpointError(f"no model.safetensors or {INDEX_NAME} in {d}")


def _files_from_index(d: Path) -> list[Path]:
    try:
        weight_map = json.loads((d / INDEX_NAME).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{d / INDEX_NAME} is malformed: {e}") from None
    files = sorted({d / f for f in weight_map.values()})
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"shard {f.name} named in {INDEX_NAME} is missing from {d}")
    return files


def read_specs(files: list[Path]) -> list[TensorSpec]:
    """Names, shapes and dtypes from the safetensors headers (no tensor data is read)."""
    specs = []
    for f in files:
        with _open(f) as st:
            for name in st.keys():
                sl = st.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"{f.name}: tensor {name!r} has unsupported dtype {sl.get_dtype()}")
                specs.append(TensorSpec(name, tuple(sl.get_shape()), dtype))
    return specs


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        with _open(f) as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path.name} is not a readable safetensors file: {e}") from None
