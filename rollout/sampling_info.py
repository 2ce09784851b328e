"""Per-batch sampling tensors, built once per step from the requests' SamplingParams."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from rollout.random_stream import seed_hash, uniform_from
from rollout.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0 (logprobs under T=1)
    top_ks: torch.Tensor  # [B] int64; vocab size when off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    uniforms: torch.Tensor  # [B] float64: the row's draw, from (seed, position of the token)
    all_greedy: bool
    needs_filter: bool  # some row uses top-k/top-p/min-p
    max_top_logprobs: int
    # Host-side facts that let the sampler skip work with no effect on the result (the tensors
    # above stay the definition). Defaults are the safe "do everything" values.
    any_greedy: bool = True  # some row is greedy: argmax needed
    all_temperature_one: bool = False  # logits / T is logits itself: no division
    _hashed: Optional[np.ndarray] = field(default=None, repr=False)  # seed_hash(seeds), host

    def set_positions(self, positions: Sequence[int]) -> None:
        """The next step of the same rows: only the positions move on, so only the uniforms
        are computed again (on the host) and shipped."""
        self.uniforms = _to_device(torch.from_numpy(uniform_from(None, positions, self._hashed)),
                                   self.uniforms.device)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
              positions: Sequence[int], vocab_size: int, device: torch.device) -> "SamplingBatchInfo":
        """Built on the host and moved in three non-blocking copies (one per dtype).
        `positions`: of the token each row samples."""
        ints = torch.tensor([[p.top_k if p.top_k > 0 else vocab_size for p in params],
                             [int(p.is_greedy) for p in params]], dtype=torch.int64)
        floats = torch.tensor([[p.temperature if p.temperature > 0 else 1.0 for p in params],
                               [p.top_p for p in params], [p.min_p for p in params]], dtype=torch.float32)
        hashed = seed_hash(list(seeds))
        uniforms = torch.from_numpy(uniform_from(None, positions, hashed))
        ints, floats, uniforms = (_to_device(t, device) for t in (ints, floats, uniforms))
        top_ks, greedy = ints.unbind(0)
        temperatures, top_ps, min_ps = floats.unbind(0)
        return cls(
            temperatures=temperatures, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps,
            greedy=greedy.bool(), uniforms=uniforms,
            all_greedy=all(p.is_greedy for p in params),
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params),
            max_top_logprobs=max((p.logprobs for p in params), default=0),
            any_greedy=any(p.is_greedy for p in params),
            all_temperature_one=all(p.is_greedy or p.temperature == 1.0 for p in params),
            _hashed=hashed,
        )


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and non-blocking for a GPU (a plain copy would wait for
    the GPU to drain, which undoes overlap scheduling)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
