"""A row's RMSNorm not yet computed: the one-row GEMV that reads the row computes it itself.

Why: at batch 1 a decode step is a chain of short kernels, and each of a layer's two residual
add + RMSNorm kernels is one more launch, wait and drain on it (~2 µs a layer each, the
fifteenth session's ablation). Both have one reader, a one-row FMA GEMV (qkv + rotary, the
gate/up + SiLU) whose every program loads the whole row anyway (K = hidden, three chunks). So the
residual add moves into the GEMV that writes the branch output (o and down add their output into
the residual stream in place: `skinny_linear(..., add_to=)`) and the norm into the GEMV that reads
it: each program sums the squares of the row chunks it loaded, and normalizes and weights them
in registers before its FMAs (`triton_gemv.fma_normed_row_sums`). The roundings are the norm
kernel's (x·rsqrt rounded, then the weight product rounded); the mean of the squares is summed in
another order, as any two reductions are (triton_ops' module docstring)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PendingNorm:
    """RMSNorm(h) with `weight` and `eps`, for a GEMV to compute on its input loads: h [M, K]
    (rows contiguous), weight [K] of h's dtype."""
    h: torch.Tensor
    weight: torch.Tensor
    eps: float

    def __post_init__(self):
        h, w = self.h, self.weight
        if h.dim() != 2 or h.stride(1) != 1:
            raise ValueError(f"h must be [M, K] with contiguous rows, got {tuple(h.shape)} "
                             f"strides {h.stride()}")
        if w.shape != (h.shape[1],) or w.dtype != h.dtype or not w.is_contiguous():
            raise ValueError(f"norm weight {tuple(w.shape)} {w.dtype} does not fit rows of "
                             f"{h.shape[1]} {h.dtype}")
        if not self.eps > 0:
            raise ValueError(f"eps={self.eps} must be > 0")

    @property
    def shape(self) -> torch.Size:
        return self.h.shape

    def tensor(self) -> torch.Tensor:
        """The norm computed by the norm kernel (for a reader that cannot take it pending)."""
        from rollout.layers import triton_ops
        return triton_ops.rms_norm(self.h, self.weight, self.eps)
