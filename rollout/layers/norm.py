"""RMSNorm computed exactly as Hugging Face does (in float32, weight applied in input dtype)."""
from __future__ import annotations

import torch
from torch import nn

from rollout.layers.weight_attrs import make_param, replicated_loader


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), replicated_loader, {None: (size,)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same math as below when nothing is cast
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
