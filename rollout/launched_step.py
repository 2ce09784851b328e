"""LaunchedStep: a batch whose forward and sampling are queued on the device, its sampled tokens
on their way to pinned host memory.

The fused GPU sampler writes them there itself (`triton_sampler`, `pack_on_host`); other paths
queue a copy to pinned memory without blocking. An event marks the end, so the scheduler can
queue the next step (whose input ids are these tokens, still on the device) before it waits:
with overlap scheduling the host's work for step N+1 runs while the GPU runs step N."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from rollout.request import Request
from rollout.sampler import SampleOutput


@dataclass
class HostSample:
    """A step's sampled tokens on the host, one entry per row of the batch."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: Optional[list[list[int]]] = None
    top_values: Optional[list[list[float]]] = None


class LaunchedStep:
    def __init__(self, reqs: list[Request], out: SampleOutput):
        self.reqs = reqs
        self.tokens = out.tokens  # device: input ids of the next decode of these requests
        self._ready: Optional[torch.cuda.Event] = None
        self._tops = None
        self._cpu: Optional[HostSample] = None
        if out.tokens.device.type != "cuda":
            # CPU ops are done when they return: read the results now, two .tolist() (no
            # stacking, no float64 copies), so nothing depends on the sampler's buffers later
            self._cpu = HostSample(out.tokens.tolist(), out.logprobs.tolist())
            if out.top_logprob_ids is not None:
                self._cpu.top_ids = out.top_logprob_ids.tolist()
                self._cpu.top_values = out.top_logprob_values.tolist()
            return
        # token ids are exact in float64, so tokens and logprobs travel in one copy
        pack = out.host_pack
        if pack is None:
            pack = torch.stack((out.tokens.double(), out.logprobs.double()))
        # a pinned pack already on its way: the fused sampler's kernel writes it, or a step
        # graph's readback copy (`step_graphs`)
        pinned_pack = pack.device.type == "cpu"
        self._host = pack if pinned_pack else _to_host(pack)
        if out.top_logprob_ids is not None:
            self._tops = (_to_host(out.top_logprob_ids), _to_host(out.top_logprob_values))
        self._ready = out.ready
        if self._ready is None:
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._guard = None
        if pinned_pack:
            # where a kernel, not a copy, writes it the pinned-memory cache does not know, so the
            # buffer must not go back to it (and to its next user) before the stream has passed
            # that kernel, even if this step is dropped unread (a copy's pack the cache tracks
            # itself: the guard is redundant there, and harmless)
            self._guard = weakref.finalize(self, _release_after, self._ready, pack)
            self._guard.atexit = False  # at exit nothing reuses the buffer

    @functools.cached_property
    def row_of(self) -> dict[int, int]:
        """Request id → row of this batch (overlap scheduling only: built on first use)."""
        return {r.rid: i for i, r in enumerate(self.reqs)}

    def wait(self) -> HostSample:
        """Blocks until the step's tokens are on the host (the step's one synchronisation)."""
        if self._cpu is not None:
            return self._cpu
        self._ready.synchronize()
        if self._guard is not None:
            self._guard.detach()
        tokens, logprobs = self._host.tolist()
        out = HostSample([int(t) for t in tokens], logprobs)
        if self._tops is not None:
            out.top_ids, out.top_values = self._tops[0].tolist(), self._tops[1].tolist()
        return out


def _release_after(ready: torch.cuda.Event, buffer: torch.Tensor) -> None:
    """Holds `buffer` until the stream has passed `ready`."""
    ready.synchronize()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
