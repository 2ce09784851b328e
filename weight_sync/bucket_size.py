"""The bucket size when the user gives none: from the receiving side's free device memory.

A receiver holds up to two buckets at once (the broadcast path double-buffers; the tensor path
moves one bucket to the device while the previous one loads), so a bucket is a fraction of the
smallest free memory of any receiving shard, clamped to [MIN, MAX] (below MIN the per-bucket
fixed costs dominate; above MAX nothing is gained and a colocated trainer loses headroom).
Without device memory to size by (CPU receivers) the default is used."""
from __future__ import annotations

from typing import Any, Optional

from weight_sync.bucket import DEFAULT_BUCKET_BYTES

FREE_FRACTION = 1 / 8
MIN_BUCKET_BYTES = 32 << 20
MAX_BUCKET_BYTES = 1 << 30


def bucket_bytes_for(free_bytes: Optional[int]) -> int:
    """The rule: `free_bytes` × FREE_FRACTION clamped to [MIN, MAX], whole MiB; None (no device
    memory: CPU) gives DEFAULT_BUCKET_BYTES."""
    if free_bytes is None:
        return DEFAULT_BUCKET_BYTES
    size = int(free_bytes * FREE_FRACTION) >> 20 << 20
    return max(MIN_BUCKET_BYTES, min(MAX_BUCKET_BYTES, size))


def resolve_bucket_bytes(target: Any, given: Optional[int]) -> tuple[int, str]:
    """(bucket bytes, where they came from): the user's value, else the rule applied to the
    target's `weight_sync_free_bytes()` (the smallest free device memory of its shards)."""
    if given is not None:
        if int(given) <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {given}")
        return int(given), "given"
    probe = getattr(target, "weight_sync_free_bytes", None)
    free = probe() if probe is not None else None
    if free is None:
        return bucket_bytes_for(None), "default (no device memory on the receiving side)"
    return bucket_bytes_for(free), f"{FREE_FRACTION:g} of the receiver's free memory ({free >> 20} MiB)"
