"""Where our Triton kernels let the next kernel launch under programmatic dependent launch
(rollout/triton_pdl.py): after their PDL wait, or before it — the early trigger, so that the
kernels after a short one become resident, and load what they may load before their wait,
several kernels ahead. Both give the same bits (each kernel still waits for its predecessor's
completion, which follows that one's own wait).

The policy ("auto"): early inside decode forwards (and their CUDA-graph captures), except the
kernels that load weights before their wait (the one-row FMA GEMVs' register preloads): those
trigger after it, since early they would pull their successors' preloads into the
latency-bound attention chain — unless the caller says otherwise (`preloaders_early`: the o
projection, whose early trigger lets the MLP's gate/up start loading its weights during o).
Prefill and the sampler: after the wait (not measured early). On an H200 (fourteenth session,
decode graph replay, medians of two rounds): `benchmarks/ab_fourteenth_session.json`, the
preloading GEMVs after the wait: batch 1 1.1413 → 1.1280 ms, 32 1.5616 → 1.5525, 64 1.5931 →
1.5753, 128 1.8620 → 1.8473 (every kernel early lost at batch 1: 1.1398 → 1.1518); then
`ab_fourteenth_session_c.json`, one GEMV at a time early too, batch 1: o 1.1196 → 1.0933, qkv
1.1827, gate/up 1.1290, down 1.1197, LM head 1.1205.

ROLLOUT_PDL_EARLY_TRIGGER: "auto" (default), "1" every launch early, "0" none.
No Triton here: the model runner imports this whether or not Triton is installed."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

MODES = ("auto", "0", "1")
_state = threading.local()  # .decode: inside a decode forward; .preloaders: preloaders early


@contextlib.contextmanager
def _set(name: str, value: bool) -> Iterator[None]:
    """This thread's policy field `name` set to `value` inside, restored after."""
    before = getattr(_state, name, False)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, before)


def decode_forward(on: bool = True) -> contextlib.AbstractContextManager:
    """The Triton kernels this thread launches inside (or captures into a CUDA graph) belong to
    a decode forward (`on`) or not."""
    return _set("decode", on)


def preloaders_early() -> contextlib.AbstractContextManager:
    """Inside a decode forward, the kernels launched here trigger early even when they preload
    weights (the o projection's GEMV: see the module docstring)."""
    return _set("preloaders", True)


def for_forward(fb) -> contextlib.AbstractContextManager:
    """The policy's context around a forward (a ForwardBatch; a decode graph's capture too)."""
    return decode_forward(fb.forward_mode.is_decode)


def triggers_early(preloads_weights: bool = False) -> bool:
    """Whether a launch now triggers its successor before its wait. `preloads_weights`: the
    kernel loads weights before its wait."""
    mode = os.environ.get("ROLLOUT_PDL_EARLY_TRIGGER", "auto")
    if mode not in MODES:
        raise ValueError(f"ROLLOUT_PDL_EARLY_TRIGGER={mode!r}: want one of {MODES}")
    if mode == "auto":
        return getattr(_state, "decode", False) and (
            not preloads_weights or getattr(_state, "preloaders", False))
    return mode == "1"
