"""The model's parameter table in Hugging Face terms: HF name → (our parameter, shard id, full
shape). Checkpoint loading and weight sync both validate against it, then load through it.

A parameter may answer to two namings: its own HF name for the whole tensor and, listed in its
`hf_pieces`, the names it is saved under piece by piece (HF's fused MoE experts are one 3-D
tensor in a trainer's `named_parameters()` and one tensor per expert in a checkpoint). Either
naming completes it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Sequence

import torch
from torch import nn

from rollout.errors import CheckpointError
from weight_sync.spec import TensorSpec, specs_of  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class WeightSlot:
    param: nn.Parameter
    shard_id: Hashable
    full_shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype


class WeightTable:
    def __init__(self, slots: dict[str, WeightSlot], ignored: Sequence[str] = (),
                 pieces: Optional[dict[str, tuple[str, ...]]] = None):
        self.slots = slots
        self.ignored = frozenset(ignored)
        # whole-tensor name → the piece names that together stand for it
        self.pieces = pieces or {}
        self._whole_of = {piece: whole for whole, names in self.pieces.items() for piece in names}

    @classmethod
    def build(cls, model: nn.Module, packed: dict[str, list[tuple[str, Hashable]]],
              ignored: Sequence[str] = ()) -> "WeightTable":
        slots: dict[str, WeightSlot] = {}
        pieces: dict[str, tuple[str, ...]] = {}
        for name, param in model.named_parameters():
            fused = next((key for key in packed if f".{key}." in name), None)
            if fused is None:
                slots[name] = WeightSlot(param, None, param.full_shapes[None])
                prefix = name.rsplit(".", 1)[0] + "."
                named = [(prefix + rel, WeightSlot(param, shard_id, shape))
                         for rel, shard_id, shape in getattr(param, "hf_pieces", ())]
                slots.update(named)
                if named:
                    pieces[name] = tuple(n for n, _ in named)
                continue
            for hf_piece, shard_id in packed[fused]:
                hf_name = name.replace(f".{fused}.", f".{hf_piece}.")
                slots[hf_name] = WeightSlot(param, shard_id, param.full_shapes[shard_id])
        return cls(slots, ignored, pieces)

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> list[str]:
        """One complete naming: whole tensors, not the pieces that stand for them."""
        return [n for n in self.slots if n not in self._whole_of]

    def validate(self, specs: Iterable[TensorSpec], *, complete: bool, exact_dtype: bool,
                 error: type[Exception] = CheckpointError) -> None:
        """Raise `error` naming the first problem: unknown name, wrong shape or dtype, a
        duplicate, or (with `complete`) a parameter nobody provided."""
        seen: set[str] = set()
        for spec in specs:
            if spec.name in self.ignored:
                continue
            slot = self.slots.get(spec.name)
            if slot is None:
                raise error(f"unknown tensor {spec.name!r}: the model has no such parameter")
            if spec.name in seen:
                raise error(f"tensor {spec.name!r} is given twice")
            seen.add(spec.name)
            if tuple(spec.shape) != slot.full_shape:
                raise error(f"tensor {spec.name!r} has shape {tuple(spec.shape)}, "
                            f"expected {slot.full_shape}")
            _check_dtype(spec, slot, exact_dtype, error)
        if complete:
            missing = [n for n in self.names() if not self._given(n, seen)]
            if missing:
                raise error(f"{len(missing)} tensor(s) missing, e.g. {missing[:3]}")

    def _given(self, name: str, seen: set[str]) -> bool:
        """`name` came whole, or as every one of its pieces."""
        pieces = self.pieces.get(name)
        return name in seen or (pieces is not None and all(p in seen for p in pieces))

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each (HF name, full tensor) into this rank's shard, in place. Validate first."""
        count = 0
        for name, tensor in weights:
            if name in self.ignored:
                continue
            slot = self.slots[name]
            slot.param.weight_loader(slot.param, tensor, slot.shard_id)
            count += 1
        return count


def _check_dtype(spec: TensorSpec, slot: WeightSlot, exact: bool, error: type[Exception]) -> None:
    if exact and spec.dtype != slot.dtype:
        raise error(f"tensor {spec.name!r} has dtype {spec.dtype}, the engine holds {slot.dtype}")
    if not spec.dtype.is_floating_point:
        raise error(f"tensor {spec.name!r} has dtype {spec.dtype}; weights must be floating point")
