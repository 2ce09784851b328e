"""Rotary position embedding (HF's rotate-half layout) with optional Llama-3 frequency scaling.

cos/sin are tabulated once for every position in float32; a forward looks them up once per
step and every layer applies them to q and k together. The CUDA kernel takes the half tables
(`lookup`); the CPU path (`lookup_full` + `apply_rotary_full_`) takes full-width tables, cos
repeated and sin signed as [-sin, sin], so a rotation is four in-place torch ops with the same
roundings as `apply_rotary`."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from rollout.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Optional[RopeScaling] = None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)  # [P, head_dim / 2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        self._full: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._half: dict[torch.dtype, torch.Tensor] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape [T, 1, head_dim / 2] for the step's positions: views of one gather
        from a [P, 2, head_dim / 2] table in `dtype` (made on first use per dtype, values
        rounded once as a cast after the lookup would), one kernel a step instead of four."""
        return split_cos_sin(self.half_table(dtype).index_select(0, positions))

    def half_table(self, dtype: torch.dtype) -> torch.Tensor:
        """[P, 2, head_dim / 2] in `dtype`: cos and sin of every position (what `lookup`
        gathers from; a fused kernel gathers from it too, `triton_embed`)."""
        table = self._half.get(dtype)
        if table is None or table.device != self.cos_cache.device:
            table = torch.stack((self.cos_cache, self.sin_cache), 1).to(dtype)
            self._half[dtype] = table
        return table

    def lookup_full(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([cos, cos], [-sin, sin]) of shape [T, 1, head_dim] in `dtype`, for `apply_rotary_full_`.
        The tables are made on first use per dtype (values rounded to `dtype` once, as `lookup`
        rounds them; negation is exact)."""
        tables = self._full.get(dtype)
        if tables is None or tables[0].device != self.cos_cache.device:
            cos, sin = self.cos_cache.to(dtype), self.sin_cache.to(dtype)
            tables = (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
            self._full[dtype] = tables
        return (tables[0].index_select(0, positions).unsqueeze(1),
                tables[1].index_select(0, positions).unsqueeze(1))


def split_cos_sin(both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2, head_dim / 2] rows of the half table → (cos, sin) views of shape [T, 1, head_dim / 2]."""
    return both[:, 0:1], both[:, 1:2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] → x·cos + rotate_half(x)·sin, computed on the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_full_(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` in place on x [T, heads, head_dim] (a view is fine), with the tables of
    `RotaryEmbedding.lookup_full`: x·[cos, cos] + [x2, x1]·[-sin, sin]. Each product is rounded
    and then summed, as in `apply_rotary` (x2·(-sin) is exactly -(x2·sin)), so the result is
    bit for bit the same."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    x.mul_(cos_full)
    return x.add_(swapped.mul_(sin_signed))
