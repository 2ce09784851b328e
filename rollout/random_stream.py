"""The sampler's random stream: one uniform per row, a pure function of (seed, position).

Counter-based (splitmix64 of the seed, mixed with the position), so a request's draws never
depend on the other requests of its batch and need no generator state. Computed on the host
(numpy, a few µs for a batch) from host ints the scheduler already has; as ~13 int64 tensor ops
per step it cost a kernel launch each on a GPU and ~10 µs each on a busy CPU."""
from __future__ import annotations

from typing import Optional

import numpy as np

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN, _M1, _M2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (numpy wraps mod 2^64; >> is logical on unsigned)."""
    x = x + _GOLDEN
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def seed_hash(seeds) -> np.ndarray:
    """splitmix64 of the seeds (int64 values, taken as their 64-bit patterns): the per-row half
    of the random stream, the same for every step of a request."""
    return splitmix64(np.asarray(seeds, dtype=np.int64).view(np.uint64))


def uniform_from(seeds, positions, hashed: Optional[np.ndarray] = None) -> np.ndarray:
    """A uniform float64 in [0, 1) per row (53 random bits). `hashed`: seed_hash(seeds) when
    the caller has it already."""
    if hashed is None:
        hashed = seed_hash(seeds)
    bits = splitmix64(hashed ^ np.asarray(positions, dtype=np.int64).view(np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def mix_seed(seed: int, index: int) -> int:
    """Seed of the index-th sample of a prompt whose request carries `seed` (pure Python)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 1) & _MASK64
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _MASK64
    return _signed((x ^ (x >> 29)) & _MASK64)
