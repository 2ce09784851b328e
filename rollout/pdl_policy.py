"""Where our Triton kernels let the next kernel launch under programmatic dependent launch
(rollout/triton_pdl.py): after their PDL wait (the default), or before it — the early trigger,
so that the kernels after a short one become resident, and load their weights, several kernels
ahead. Both give the same bits (each kernel still waits for its predecessor's completion).

Measured on an H200 (fourteenth session, `benchmarks/ab_fourteenth_session.json`): the early
trigger shortens the decode step at batches of 32-128 (graph 0.6-1.3%) and lengthens it at
batch 1 (+1.1%: the one-row GEMVs' weight preloads then run ahead into the latency-bound
attention chain). So the model runner asks for it around decode forwards (and their CUDA-graph
captures) of more than EARLY_TRIGGER_MIN_BATCH requests. ROLLOUT_PDL_EARLY_TRIGGER: "auto"
(default) that policy, "1" every launch, "0" none.

No Triton here: the model runner imports this whether or not Triton is installed."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

EARLY_TRIGGER_MIN_BATCH = 16  # the one-row / FMA GEMVs' batches (triton_gemv.FMA_MAX_M) stay out
_state = threading.local()  # .early: this thread's launches trigger early (mode "auto")


@contextlib.contextmanager
def early_trigger(on: bool = True) -> Iterator[None]:
    """The Triton kernels this thread launches inside (or captures into a CUDA graph) trigger
    their successor before their wait, when ROLLOUT_PDL_EARLY_TRIGGER is "auto"."""
    before = getattr(_state, "early", False)
    _state.early = on
    try:
        yield
    finally:
        _state.early = before


def for_forward(fb) -> contextlib.AbstractContextManager:
    """The policy around a forward (a ForwardBatch; a decode graph's capture included): early in
    decode batches above EARLY_TRIGGER_MIN_BATCH, after the wait otherwise (prefill too)."""
    return early_trigger(fb.forward_mode.is_decode and fb.batch_size > EARLY_TRIGGER_MIN_BATCH)


def triggers_early() -> bool:
    """Whether a launch now triggers its successor before its wait."""
    mode = os.environ.get("ROLLOUT_PDL_EARLY_TRIGGER", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"ROLLOUT_PDL_EARLY_TRIGGER={mode!r}: want auto, 0 or 1")
    return mode == "1" or (mode == "auto" and getattr(_state, "early", False))
