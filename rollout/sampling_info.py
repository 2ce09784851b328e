"""Per-batch sampling tensors, built once per step from the requests' SamplingParams."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

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
    # Host-side facts that let the sampler skip work with no effect on the result (the tensors
    # above stay the definition). Defaults are the safe "do everything" values.
    any_greedy: bool = True  # some row is greedy: argmax needed
    all_temperature_one: bool = False  # logits / T is logits itself: no division
    _seed_hash: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    def seed_hash(self) -> torch.Tensor:
        """splitmix64(seeds): the per-row half of the random stream, the same every step of a
        batch (only `positions` moves on), so computed once per `seeds` tensor."""
        from rollout.sampler import splitmix64
        if self._seed_hash is None or self._seed_hash[0] is not self.seeds:
            self._seed_hash = (self.seeds, splitmix64(self.seeds))
        return self._seed_hash[1]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
              positions: Sequence[int], vocab_size: int, device: torch.device) -> "SamplingBatchInfo":
        """Built on the host and moved in two non-blocking copies (one per dtype): a plain
        `torch.tensor(..., device=cuda)` would wait for the GPU to drain, which undoes overlap
        scheduling every time the batch changes."""
        ints = torch.tensor([[p.top_k if p.top_k > 0 else vocab_size for p in params], list(seeds),
                             list(positions), [int(p.is_greedy) for p in params]], dtype=torch.int64)
        floats = torch.tensor([[p.temperature if p.temperature > 0 else 1.0 for p in params],
                               [p.top_p for p in params], [p.min_p for p in params]], dtype=torch.float32)
        if device.type != "cpu":
            ints = ints.pin_memory().to(device, non_blocking=True)
            floats = floats.pin_memory().to(device, non_blocking=True)
        top_ks, seeds_t, positions_t, greedy = ints.unbind(0)
        temperatures, top_ps, min_ps = floats.unbind(0)
        return cls(
            temperatures=temperatures, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps,
            greedy=greedy.bool(), seeds=seeds_t, positions=positions_t,
            all_greedy=all(p.is_greedy for p in params),
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params),
            max_top_logprobs=max((p.logprobs for p in params), default=0),
            any_greedy=any(p.is_greedy for p in params),
            all_temperature_one=all(p.is_greedy or p.temperature == 1.0 for p in params),
        )
