"""Programmatic dependent launch (PDL, Hopper and newer) for our Triton kernels.

A decode step at small batch is a chain of ~400 short kernels, and between two of them the GPU
idles while the next one launches and its blocks are placed. With PDL a kernel may launch while
its predecessor in the stream still runs: its blocks become resident and wait in `pdl_wait`
until the predecessor has finished and its writes are visible. The rule that keeps this exact:
every kernel calls `pdl_wait` before it reads anything an earlier kernel wrote and before it
writes anything at all (so reused memory is never written while an earlier kernel reads it);
completion stays ordered along the stream, so the rule holds transitively. Kernels from other
libraries (torch, cuBLAS) launch as usual and order as usual.

On by default where it applies (compiled kernels on a compute capability >= 9 GPU);
ROLLOUT_PDL=0 turns it off.

Where a kernel lets the next one launch (after its wait or before it): rollout/pdl_policy.py."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from rollout import pdl_policy

_enabled: Optional[bool] = None
EARLY_TRIGGER: tl.constexpr = tl.constexpr(2)  # USE_PDL value: trigger the next kernel, then wait


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel of the stream (and its writes), then let the next one
    launch. First thing a kernel does (see the module docstring). USE_PDL == EARLY_TRIGGER: let
    the next one launch first, then wait — still exact (the next kernel waits for this one's
    completion, which follows this one's wait), and the kernels after a short one can be
    resident and loading their weights several kernels ahead."""
    if USE_PDL == EARLY_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def enabled() -> bool:
    global _enabled
    if _enabled is None:
        _enabled = (os.environ.get("ROLLOUT_PDL", "1") != "0"
                    and os.environ.get("TRITON_INTERPRET", "0") != "1"
                    and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0))
    return _enabled


def launch_options(preloads_weights: bool = False) -> dict:
    """Keyword arguments for a kernel launch: the kernel's USE_PDL flag (EARLY_TRIGGER under the
    early-trigger policy, pdl_policy), and the launch attribute that lets it start before its
    predecessor ends. `preloads_weights`: the kernel loads weights before its wait."""
    if not enabled():
        return {"USE_PDL": False}
    early = pdl_policy.triggers_early(preloads_weights)
    return {"USE_PDL": EARLY_TRIGGER.value if early else True, "launch_pdl": True}
