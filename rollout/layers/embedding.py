"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout.config import ceil_div
from rollout.distributed import SINGLE, TPGroup
from rollout.layers.linear import linear
from rollout.layers.weight_attrs import copy_into, make_param


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.per_rank = ceil_div(vocab_size, tp.size)  # the last rank's tail rows stay zero
        self.vocab_start = tp.rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, vocab_size)
        self.weight = make_param((self.per_rank, hidden), self.weight_loader,
                                 {None: (vocab_size, hidden)})

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Hashable = None) -> None:
        n = self.vocab_end - self.vocab_start
        copy_into(param.data[:n], full.narrow(0, self.vocab_start, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states → full-vocabulary logits (each rank's slice, gathered)."""

    def compute_logits(self, hidden: torch.Tensor, packed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`packed`: the weight's `pack_cpu_weight` copy (CPU), or None."""
        logits = self.tp.all_gather_last_dim(linear(hidden, self.weight, None, packed))
        return logits[..., : self.vocab_size]
