"""The one-row MLP's hand-off from gate/up to down through ready counters, without down waiting
for gate/up's whole grid.

At batch 1 the MLP is two GEMVs that stream 82.5 MB of weights (Qwen2-1.5B) and hold most of a
decode step. Under PDL, down's programs become resident while gate/up's last programs run and
load their first weight chunks, then wait for gate/up's whole grid to complete (its last
program, the memory flush) before they read its output: the bandwidth dips at that boundary,
as at every kernel boundary of the step. Here down's programs of K split s
await only the gate/up columns of that split: each gate/up program adds the columns it wrote to
the counter of down's K chunk they fall in (a release after its stores), and a down program
spins (relaxed loads, then one acquire) until the counters of its split's chunks are full. The
programs of down's first split thus run while gate/up's last programs are still streaming
their weights.

Why it is safe:
  * no deadlock: down's programs launch (PDL) only after every gate/up program has passed its
    own PDL wait (gate/up, a weight preloader, triggers after it), so every gate/up program is
    resident or done when a down program spins; without PDL down starts after gate/up ends.
  * no write hazard without down's PDL wait: down writes only its output and partials,
    allocated here before gate/up is launched (so no running kernel reads that memory); it
    reads weights, gate/up's output (awaited) and the counters.
  * the counters are zero between calls: the reader of down's partials (the residual add +
    RMSNorm after the MLP, after its PDL wait, i.e. once down has completed) zeroes them
    (`SplitSum.reset`), and the next call's gate/up adds only after its own PDL wait. Counters
    left unzeroed (a launch lost to a host error, a result never read) are zeroed by the next
    call first (`HandoffCounters.pending`).
  * one counter per 32-byte sector (triton_gemv.HANDOFF_STRIDE), one per K chunk of down (18
    at Qwen2-1.5B's intermediate size, 256 adds each): adds to one address serialize in the L2.
The sums are the plain launches' (the same kernels and configs, the same order), so the output
is theirs bit for bit. ROLLOUT_MLP_HANDOFF=0: the plain launches.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from rollout.layers import linear
from rollout.layers.split_sum import SplitSum

HANDOFF = os.environ.get("ROLLOUT_MLP_HANDOFF", "1") != "0"


class HandoffCounters:
    """One MLP's counters on the device (int32, one per K chunk of down, HANDOFF_STRIDE apart;
    a power-of-two size, as the norm kernel zeroes them), made on first use; `pending` from a
    hand-off's launch until the zeroing of its counters is queued (`mark_zeroed`)."""

    def __init__(self):
        self.tensor: Optional[torch.Tensor] = None
        self.pending = False

    def take(self, chunks: int, stride: int, device: torch.device) -> torch.Tensor:
        slots = 1 << max(0, chunks * stride - 1).bit_length()
        t = self.tensor
        if t is None or t.numel() != slots or t.device != device:
            t = self.tensor = torch.zeros(slots, dtype=torch.int32, device=device)
        elif self.pending:  # the last hand-off's counters were never zeroed
            t.zero_()
        self.pending = True
        return t

    def mark_zeroed(self) -> None:
        self.pending = False


def applies(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """x is one row on CUDA and both GEMVs run on the one-row FMA kernel with configs that
    allow the hand-off (gate/up unsplit, its program's columns inside one of down's splits)."""
    if not (HANDOFF and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and linear.use_skinny(x, w_gate_up, gated=True)):
        return False
    from rollout.layers import triton_gemv
    inter = w_gate_up.shape[0] // 2
    if not (w_down.dim() == 2 and w_down.shape[1] == inter and w_down.dtype == x.dtype
            and w_down.device == x.device and w_down.is_contiguous()):
        return False
    key = (1, w_down.shape[0], inter, False)
    if key in triton_gemv._TUNED and triton_gemv._TUNED[key] is None:
        return False  # the table sends this down to cuBLAS
    return _configs(x.shape[1], inter, w_down.shape[0]) is not None


def _configs(hidden: int, inter: int, out: int):
    """(gate/up config, down config, the columns a counter stands for), or None."""
    from rollout.layers import triton_gemv
    gate_up = triton_gemv._config(1, 2 * inter, hidden, True)
    down = triton_gemv._config(1, out, inter)
    # down split along K with its partials read by the norm, which zeroes the counters
    if (gate_up.dot or gate_up.tma or gate_up.split_k != 1 or down.dot or down.tma
            or down.split_k < 2 or not linear.DEFER_SPLIT_K):
        return None
    if down.block_k % gate_up.block_n:  # a gate/up program's columns in one chunk of down
        return None
    return gate_up, down, down.block_k


def one_row_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                counters: HandoffCounters) -> SplitSum:
    """down(silu(gate) · up) for one row x (`applies` must hold): down's split-K partials as a
    SplitSum for the residual add + RMSNorm after it (as `MLP.forward`), which zeroes the
    counters (`SplitSum.reset`)."""
    from rollout.layers import triton_gemv
    inter = w_gate_up.shape[0] // 2
    gate_up_cfg, down_cfg, span = _configs(x.shape[1], inter, w_down.shape[0])
    split = down_cfg.split_k
    # everything down writes is allocated before gate/up launches (see the module docstring)
    h = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, w_down.shape[0], dtype=x.dtype, device=x.device)
    partials = triton_gemv.split_partials(1, w_down.shape[0], False, split, out)
    ready = counters.take(-(-inter // span), triton_gemv.HANDOFF_STRIDE.value, x.device)
    triton_gemv._launch(x, w_gate_up, None, h, True, gate_up_cfg,
                        handoff=triton_gemv.Handoff(ready, span, triton_gemv.HANDOFF_SIGNAL.value))
    result = triton_gemv._launch(h, w_down, None, out, False, down_cfg, defer_split=True,
                                 handoff=triton_gemv.Handoff(ready, span,
                                                             triton_gemv.HANDOFF_AWAIT.value),
                                 partials=partials)
    return dataclasses.replace(result, reset=counters)  # its reader zeroes the counters
