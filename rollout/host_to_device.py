"""A step's metadata from the host to the GPU on a copy stream of its own.

Each step's indices (and sampling uniforms) go to the device in one non-blocking copy. Queued
on the compute stream, that copy waits behind everything the stream holds — with overlap
scheduling, the whole previous step — and then costs the next step its own time plus a launch
gap on each side. On a stream of its own it runs at once, while the previous step computes,
and the compute stream only waits on an event that has long passed.

The destination is allocated on the copy stream and marked as used by the compute stream
(`record_stream`), so the caching allocator neither hands the copy a block the compute stream
still reads nor frees the copy's block before the compute stream is done with it.
ROLLOUT_COPY_STREAM=0 queues the copies on the compute stream (the code before)."""
from __future__ import annotations

import os
from typing import Optional

import torch

COPY_STREAM = os.environ.get("ROLLOUT_COPY_STREAM", "1") != "0"

_streams: dict[torch.device, torch.cuda.Stream] = {}


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor, pinned or not) on `device`, without blocking the host. On a CPU
    device, `host` itself."""
    if device.type != "cuda":
        return host
    pinned = host if host.is_pinned() else host.pin_memory()
    stream = copy_stream(device)
    if stream is None:
        return pinned.to(device, non_blocking=True)
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        out = pinned.to(device, non_blocking=True)
    compute.wait_stream(stream)
    out.record_stream(compute)
    return out


def copy_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The device's copy stream; None when switched off or while a CUDA graph is captured (a
    capture must not fork onto another stream unjoined)."""
    if not COPY_STREAM or torch.cuda.is_current_stream_capturing():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    return stream
