"""Tensor-parallel process-group state: who this rank is and how it talks to its peers.

A `TPGroup` is passed explicitly to every parallel layer (never a module global), so a process
can hold several engines and a test can build a sharded layer without any distributed set-up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """One tensor-parallel group. `group` carries activations (NCCL on GPU, gloo on CPU);
    `cpu_group` (gloo) carries the leader's per-step batch metadata."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None
    cpu_group: Optional[Any] = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard_range(self, full: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of `full` items."""
        if full % self.size:
            raise ValueError(f"{full} items do not split evenly over tp_size={self.size}")
        per = full // self.size
        return self.rank * per, per


SINGLE = TPGroup()
