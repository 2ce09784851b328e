"""oneDNN pre-packed copies of a model's CPU fp32 GEMM weights.

Given the plain weight, oneDNN reorders it into its blocked layout on every call: a tenth of a
64-row GEMM, and a quarter of a 4-row decode step here. Each weight is reordered once, on first
use, and the copy is kept until the weights may change. One cache per model, owned by the
model; every path that writes weights (`load_weights`, a weight-sync write phase — including a
registered-IPC copy plan, which writes parameter storage without going through `load_weights` —
`import_weights`, memory release and resume) calls `clear()`, so a stale copy is never read.
Costs a second copy of those weights in host memory, so it is off unless the engine's config
turns it on (the CPU default)."""
from __future__ import annotations

from typing import Optional

import torch

from rollout.layers.cpu_gemm import pack_cpu_weight


class PackedWeights:
    def __init__(self) -> None:
        self.enabled = False
        # id(weight) (or a tagged id) -> (weight, packed): keeping the weight alive keeps its id
        # from being reused
        self._cache: dict = {}

    def __call__(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """The packed copy of `weight` (made now if missing), or None when packing is off or
        oneDNN does not take this weight."""
        if not self.enabled:
            return None
        hit = self._cache.get(id(weight))
        if hit is None:
            hit = self._cache[id(weight)] = (weight, pack_cpu_weight(weight))
        return hit[1]

    def halves(self, weight: torch.Tensor, first_rows: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Packed copies of weight[:first_rows] and weight[first_rows:] (a fused gate/up weight's
        two projections), or None when packing is off or oneDNN does not take them."""
        if not self.enabled:
            return None
        key = ("halves", id(weight))
        hit = self._cache.get(key)
        if hit is None:
            parts = (pack_cpu_weight(weight[:first_rows]), pack_cpu_weight(weight[first_rows:]))
            hit = self._cache[key] = (weight, None if None in parts else parts)
        return hit[1]

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        return sum(p is not None for _, p in self._cache.values())
