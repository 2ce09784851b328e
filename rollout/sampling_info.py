"""Per-batch sampling tensors, built once per step from the requests' SamplingParams."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rollout.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0 (logprobs under T=1)
    top_ks: torch.Tensor  # [B] int64; vocab size when off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: position of the token being sampled
    all_greedy: bool
    needs_filter: bool  # some row uses top-k/top-p/min-p
    max_top_logprobs: int

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
              positions: Sequence[int], vocab_size: int, device: torch.device) -> "SamplingBatchInfo":
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        return cls(
            temperatures=t([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32),
            top_ks=t(top_ks, torch.int64),
            top_ps=t([p.top_p for p in params], torch.float32),
            min_ps=t([p.min_p for p in params], torch.float32),
            greedy=t([p.is_greedy for p in params], torch.bool),
            seeds=t(seeds, torch.int64),
            positions=t(positions, torch.int64),
            all_greedy=all(p.is_greedy for p in params),
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params),
            max_top_logprobs=max((p.logprobs for p in params), default=0),
        )
