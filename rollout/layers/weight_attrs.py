"""Per-parameter loading metadata: each Parameter carries its own `weight_loader` and the
full (unsharded) HF shape of every shard it is made of."""
from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
from torch import nn

# shard_id None: the parameter is one HF tensor; otherwise a piece of a fused parameter.
FullShapes = dict[Hashable, tuple[int, ...]]


def make_param(shape: tuple[int, ...], loader: Callable[..., None], full_shapes: FullShapes) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader
    param.full_shapes = full_shapes
    return param


def copy_into(dst: torch.Tensor, src: Any) -> None:
    """In place, so anything holding `dst` (captured CUDA graphs, views) sees the new values.
    `src` is a tensor or a lazy checkpoint slice (weight_sync.disk.LazySlice)."""
    if not isinstance(src, torch.Tensor):
        src = src.materialize()
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype), non_blocking=True)


def replicated_loader(param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
    copy_into(param.data, full)
