"""The version an update lands as: the caller's, or the current one plus one."""
from __future__ import annotations

from typing import Optional

from weight_sync.errors import WeightUpdateError


def next_version(current: int, version: Optional[int]) -> int:
    """`version` checked (a non-negative int: outputs carry it per token, so a string or a bool
    must not slip in as a number), or `current + 1` when None. A lower version than the current
    one is allowed: a trainer restarted from an earlier checkpoint numbers its steps again."""
    if version is None:
        return current + 1
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightUpdateError(f"version must be a non-negative int (or None: the current "
                                f"version + 1), got {version!r}")
    return version
