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


def keep_mask(probs: torch.Tensor, info: SamplingBatchInfo) -> Optional[torch.Tensor]:
    """[B, vocab] bool: the tokens that survive top-k → top-p → min-p (None: no row filters).

    The survivors of each row are all tokens at or above one probability threshold, found on the
    sorted row; sampling then runs over the vocabulary in its own order. So a row that does not
    filter keeps everything and draws the same token whatever the rest of the batch asks for."""
    if not info.needs_filter:
        return None
    sorted_p, _ = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    kept = sorted_p.masked_fill(rank >= info.top_ks.view(-1, 1), 0.0)
    mass_before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)
    kept = kept.masked_fill(mass_before >= info.top_ps.view(-1, 1), 0.0)
    kept = kept.masked_fill(kept < kept[:, :1] * info.min_ps.view(-1, 1), 0.0)
    num_kept = (kept > 0).sum(-1, keepdim=True).clamp(min=1)
    return probs >= sorted_p.gather(1, num_kept - 1)  # ties at the threshold survive together


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
    """Inverse CDF, in vocabulary order, of the filtered distribution at one uniform per row."""
    mask = keep_mask(probs, info)
    if mask is not None:
        probs = probs * mask
    cdf = probs.double().cumsum(-1)
    target = uniform_from(info.seeds, info.positions).view(-1, 1) * cdf[:, -1:]
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    # u * total can round up to total (u within 2^-53 of 1): fall back to the likeliest survivor
    landed = probs.gather(1, choice) > 0
    return torch.where(landed, choice, probs.argmax(-1, keepdim=True)).squeeze(1)
