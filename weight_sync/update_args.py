"""An update's arguments checked where every side can: the version it lands as, and how the
requests in flight are treated while it loads (`pause_mode`)."""
from __future__ import annotations

import operator
from typing import Optional

import torch

from weight_sync.errors import WeightUpdateError

# abort: in-flight requests end now with their tokens; retract: back to the queue, their KV
# recomputed under the new weights; in_place: they keep their KV and go on
PAUSE_MODES = ("abort", "retract", "in_place")


def next_version(current: int, version: Optional[int]) -> int:
    """`version` checked (a non-negative integer, as a Python int: outputs carry it per token, so
    a string, a float or a bool must not slip in as a number), or `current + 1` when None. A lower version than the current
    one is allowed: a trainer restarted from an earlier checkpoint numbers its steps again."""
    if version is None:
        return current + 1
    try:  # ints, and what stands for one: a numpy integer, a 0-d integer tensor (a step counter)
        boolean = isinstance(version, bool) or getattr(version, "dtype", None) == torch.bool
        value = -1 if boolean else operator.index(version)
    except TypeError:
        value = -1
    if value < 0:
        raise WeightUpdateError(f"version must be a non-negative int (or None: the current "
                                f"version + 1), got {version!r}")
    return value


def check_pause_mode(pause_mode: Optional[str], error: type[Exception] = WeightUpdateError) -> None:
    """None (the target's configured mode) or one of PAUSE_MODES, else `error` (the engine and
    the controller raise ConfigError; a sender checks before any byte moves, as a broadcast the
    receiver refused would wait out its timeout)."""
    if pause_mode is not None and pause_mode not in PAUSE_MODES:
        raise error(f"pause_mode must be one of {PAUSE_MODES} (or None), got {pause_mode!r}")
