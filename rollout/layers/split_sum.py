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
from typing import Optional

import torch


@dataclass(frozen=True)
class SplitSum:
    """fp32 partials [S, M, N] whose sum in split order (+ `bias`, in fp32), rounded to `out`'s
    dtype, is an [M, N] GEMM output; `out` is the GEMM's output tensor, not written yet: the
    reader that sums the partials may write it (the rotary kernel does), and `tensor()` sums
    them into it for a reader that cannot take the partials."""
    partials: torch.Tensor
    out: torch.Tensor
    bias: Optional[torch.Tensor] = None  # [N], added to the sum before the rounding

    def __post_init__(self):
        p = self.partials
        if p.dim() != 3 or p.dtype != torch.float32 or not p.is_contiguous() or p.shape[0] < 2:
            raise ValueError(f"partials must be contiguous fp32 [S >= 2, M, N], got "
                             f"{tuple(p.shape)} {p.dtype}")
        if self.out.shape != p.shape[1:] or not self.out.is_contiguous():
            raise ValueError(f"out {tuple(self.out.shape)} is not a contiguous "
                             f"{tuple(p.shape[1:])} tensor")
        if self.bias is not None and (self.bias.shape != (p.shape[2],)
                                      or not self.bias.is_contiguous()):
            raise ValueError(f"bias {tuple(self.bias.shape)} does not fit partials "
                             f"{tuple(p.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.out.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    @property
    def splits(self) -> int:
        return self.partials.shape[0]

    def tensor(self) -> torch.Tensor:
        """`out`, the partials summed into it by triton_gemv's reduce kernel."""
        from rollout.layers import triton_gemv  # lazily: a SplitSum only comes from there
        triton_gemv.reduce_split(self.partials, self.bias, self.out, False, self.splits)
        return self.out
