"""A GEMM output still held as split-K partials, summed by the kernel that reads it next.

Why: a decode GEMM split along K (down's K = 8,960; o at decode batches, for more programs)
writes fp32 partials [S, M, N], and a reduce kernel sums them before the next op reads the
output. In a decoder layer that next op is the residual add + RMSNorm, one kernel that reads the
whole row anyway: it can sum the partials itself (`triton_ops.split_add_rms_norm`), and the
reduce kernel goes away. Likewise qkv's partials (and its bias) for the rotary kernel that reads
qkv next (`triton_ops.apply_rotary_inplace(..., source=...)`). The sum is the reduce
kernel's, in split order, rounded once to the output dtype, so the result is the same bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class SplitSum:
    """fp32 partials [S, M, N] whose sum in split order (+ `bias`, in fp32), rounded to `dtype`,
    is an [M, N] GEMM output; `reduce` computes that tensor for a reader that cannot take the
    partials."""
    partials: torch.Tensor
    dtype: torch.dtype
    reduce: Callable[["SplitSum"], torch.Tensor]
    bias: Optional[torch.Tensor] = None  # [N], added to the sum before the rounding

    def __post_init__(self):
        p = self.partials
        if p.dim() != 3 or p.dtype != torch.float32 or not p.is_contiguous() or p.shape[0] < 2:
            raise ValueError(f"partials must be contiguous fp32 [S >= 2, M, N], got "
                             f"{tuple(p.shape)} {p.dtype}")
        if self.bias is not None and (self.bias.shape != (p.shape[2],)
                                      or not self.bias.is_contiguous()):
            raise ValueError(f"bias {tuple(self.bias.shape)} does not fit partials "
                             f"{tuple(p.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    @property
    def splits(self) -> int:
        return self.partials.shape[0]

    def tensor(self) -> torch.Tensor:
        return self.reduce(self)
