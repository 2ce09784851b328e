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
from typing import Iterator, Optional

EARLY_TRIGGER_MIN_BATCH = 16  # the one-row / FMA GEMVs' batches (triton_gemv.FMA_MAX_M) stay out
_state = threading.local()  # .decode_batch: the decode forward this thread is in (None: none)
MODES = ("auto", "0", "1", "light")


@contextlib.contextmanager
def decode_forward(batch_size: Optional[int]) -> Iterator[None]:
    """The Triton kernels this thread launches inside (or captures into a CUDA graph) belong to
    a decode forward of `batch_size` requests (None: not a decode forward)."""
    before = getattr(_state, "decode_batch", None)
    _state.decode_batch = batch_size
    try:
        yield
    finally:
        _state.decode_batch = before


def for_forward(fb) -> contextlib.AbstractContextManager:
    """The policy's context around a forward (a ForwardBatch; a decode graph's capture too)."""
    return decode_forward(fb.batch_size if fb.forward_mode.is_decode else None)


def triggers_early(preloads_weights: bool = False) -> bool:
    """Whether a launch now triggers its successor before its wait. `preloads_weights`: the
    kernel loads weights before its wait (the one-row FMA GEMVs; mode "light" keeps those
    after the wait in every decode forward, the experiment's other policy)."""
    mode = os.environ.get("ROLLOUT_PDL_EARLY_TRIGGER", "auto")
    if mode not in MODES:
        raise ValueError(f"ROLLOUT_PDL_EARLY_TRIGGER={mode!r}: want one of {MODES}")
    batch = getattr(_state, "decode_batch", None)
    if mode == "auto":
        return batch is not None and batch > EARLY_TRIGGER_MIN_BATCH
    if mode == "light":
        return batch is not None and not preloads_weights
    return mode == "1"
