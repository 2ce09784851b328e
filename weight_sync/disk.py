"""Disk transport: the trainer writes a HF safetensors directory atomically; each TP rank reads
only its slices (`get_slice`) through lazy tensors that the weight loaders narrow."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                      "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class LazySlice:
    """A checkpoint tensor not yet read: `narrow` reads only the asked rows/columns."""

    def __init__(self, st_slice):
        self._slice = st_slice
        self.shape = tuple(st_slice.get_shape())
        self.dtype = SAFETENSORS_DTYPES[st_slice.get_dtype()]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def materialize(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]


def iter_lazy(files: Iterable[Path], names: set[str] | None = None) -> Iterator[tuple[str, LazySlice]]:
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if names is None or name in names:
                    yield name, LazySlice(st.get_slice(name))


def save_atomic(named: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                max_shard_bytes: int = 4 << 30) -> Path:
    """Write a HF safetensors directory (sharded with an index past `max_shard_bytes`) to a
    temporary sibling, then rename it into place: readers never see a half-written checkpoint."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shards = _shard(named, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            _save_sharded(shards, tmp)
    except BaseException:  # a full disk, a bad tensor: no half-written sibling left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _shard(named, max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, cur, size = [], {}, 0
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        if cur and size + t.nbytes > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.nbytes
    return shards + [cur]


def _save_sharded(shards: list[dict[str, torch.Tensor]], tmp: Path) -> None:
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(t.nbytes for p in shards for t in p.values())},
             "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
