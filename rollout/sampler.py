"""Vectorised sampling over the batch: greedy, temperature, top-k → top-p → min-p (each on the
renormalised survivors of the previous, as HF applies them), and the log-probability of each
sampled token under softmax(logits / T) over the full vocabulary.

Randomness is counter-based: one uniform per row from a hash of (seed, position), turned into a
token by inverse-CDF over the filtered distribution. A row's draw thus never depends on which
other requests share the batch, and needs no generator state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rollout.sampling_info import SamplingBatchInfo

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_from(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform float64 in [0, 1) per row, a pure function of (seed, position)."""
    bits = splitmix64(splitmix64(seeds) ^ positions)
    return _shr(bits, 11).double() * (2.0 ** -53)


def mix_seed(seed: int, index: int) -> int:
    """Seed of the index-th sample of a prompt whose request carries `seed` (pure Python)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 1) & _MASK64
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _MASK64
    return _signed((x ^ (x >> 29)) & _MASK64)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_logprob_values: Optional[torch.Tensor] = None  # [B, k]
    top_logprob_ids: Optional[torch.Tensor] = None  # [B, k]


def filtered_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (descending) probabilities with filtered entries zeroed, and their token ids."""
    sorted_p, ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    sorted_p = sorted_p.masked_fill(rank >= info.top_ks.view(-1, 1), 0.0)
    mass = sorted_p.sum(-1, keepdim=True)
    mass_before = (sorted_p.cumsum(-1) - sorted_p) / mass
    sorted_p = sorted_p.masked_fill(mass_before >= info.top_ps.view(-1, 1), 0.0)
    threshold = sorted_p[:, :1] * info.min_ps.view(-1, 1)
    sorted_p = sorted_p.masked_fill(sorted_p < threshold, 0.0)
    return sorted_p, ids


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
    """logits: [B, vocab] float32 → one token per row (no host synchronisation)."""
    logprobs_all = torch.log_softmax(logits / info.temperatures.view(-1, 1), dim=-1)
    tokens = logits.argmax(dim=-1)
    if not info.all_greedy:
        tokens = torch.where(info.greedy, tokens, _draw(logprobs_all.exp(), info))
    out = SampleOutput(tokens, logprobs_all.gather(1, tokens.view(-1, 1)).squeeze(1))
    if info.max_top_logprobs > 0:
        out.top_logprob_values, out.top_logprob_ids = logprobs_all.topk(info.max_top_logprobs, dim=-1)
    return out


def _draw(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    if info.needs_filter:
        sorted_p, ids = filtered_probs(probs, info)
    else:
        sorted_p, ids = probs, None
    cdf = sorted_p.double().cumsum(-1)
    target = uniform_from(info.seeds, info.positions).view(-1, 1) * cdf[:, -1:]
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    # A draw that lands past the last kept entry (rounding) falls back to the last kept one.
    last_kept = (sorted_p > 0).sum(-1, keepdim=True) - 1 if ids is not None else choice
    choice = torch.minimum(choice, last_kept.clamp(min=0))
    return choice.squeeze(1) if ids is None else ids.gather(1, choice).squeeze(1)
