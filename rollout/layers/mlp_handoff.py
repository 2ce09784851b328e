"""The one-row MLP's hand-off from gate/up to down through ready counters, without down waiting
for gate/up's whole grid.

At batch 1 the MLP is two GEMVs that stream 82.5 MB of weights (Qwen2-1.5B) and hold most of a
decode step. Under PDL, down's programs become resident while gate/up's last programs run and
load their first weight chunks, then wait for gate/up's whole grid to complete (its last
program, the memory flush) before they read its output: the bandwidth dips at that boundary,
as at every kernel boundary of the step. Here down's programs of K split s await only the
gate/up columns of that split: each gate/up program adds the columns it wrote to the split's
counter (a release after its stores), and a down program spins (acquire) until its split's
counter is full. The programs of down's first split thus run while gate/up's last programs are
still streaming their weights.

Why it is safe:
  * no deadlock: down's programs launch (PDL) only after every gate/up program has passed its
    own PDL wait (gate/up, a weight preloader, triggers after it), so every gate/up program is
    resident or done when a down program spins; without PDL down starts after gate/up ends.
  * no write hazard without down's PDL wait: down writes only its output and partials,
    allocated here before gate/up is launched (so no running kernel reads that memory); it
    reads weights, gate/up's output (awaited) and the counters.
  * the counters are zero between calls: down's last program to finish zeroes them, and the next
    call's gate/up adds only after its own PDL wait, i.e. after that down completed. A gate/up
    launched without its down (a host error between the two launches) leaves them dirty: the
    next call zeroes them first (`HandoffCounters.pending`).
The sums are the plain launches' (the same kernels and configs, the same order), so the output
is theirs bit for bit. ROLLOUT_MLP_HANDOFF=0: the plain launches.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import torch

from rollout.layers import linear
from rollout.layers.split_sum import SplitSum

HANDOFF = os.environ.get("ROLLOUT_MLP_HANDOFF", "1") != "0"


class HandoffCounters:
    """One MLP's counters on the device (int32: one per K split of down, then down's finished
    programs), made on first use; `pending` while a gate/up launch awaits its down."""

    def __init__(self):
        self.tensor: Optional[torch.Tensor] = None
        self.pending = False

    def take(self, slots: int, device: torch.device) -> torch.Tensor:
        t = self.tensor
        if t is None or t.numel() != slots or t.device != device:
            t = self.tensor = torch.zeros(slots, dtype=torch.int32, device=device)
        elif self.pending:  # the last gate/up ran without its down: its adds are still there
            t.zero_()
        self.pending = True
        return t


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
    """(gate/up config, down config, down's K range a split covers), or None."""
    from rollout.layers import triton_gemv
    gate_up = triton_gemv._config(1, 2 * inter, hidden, True)
    down = triton_gemv._config(1, out, inter)
    if gate_up.dot or gate_up.tma or gate_up.split_k != 1 or down.dot or down.tma:
        return None
    _, span = triton_gemv.split_k_range(inter, down)
    if span % gate_up.block_n:
        return None
    return gate_up, down, span


def one_row_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                counters: HandoffCounters) -> Union[torch.Tensor, SplitSum]:
    """down(silu(gate) · up) for one row x (`applies` must hold): down's output, or its split-K
    partials as a SplitSum for the residual add + RMSNorm after it (as `MLP.forward`)."""
    from rollout.layers import triton_gemv
    inter = w_gate_up.shape[0] // 2
    gate_up_cfg, down_cfg, span = _configs(x.shape[1], inter, w_down.shape[0])
    split = down_cfg.split_k
    # everything down writes is allocated before gate/up launches (see the module docstring)
    h = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, w_down.shape[0], dtype=x.dtype, device=x.device)
    partials = triton_gemv.split_partials(1, w_down.shape[0], False, split, out)
    ready = counters.take(split + 1, x.device)
    triton_gemv._launch(x, w_gate_up, None, h, True, gate_up_cfg,
                        handoff=triton_gemv.Handoff(ready, span, triton_gemv.HANDOFF_SIGNAL.value))
    result = triton_gemv._launch(h, w_down, None, out, False, down_cfg,
                                 defer_split=linear.DEFER_SPLIT_K,
                                 handoff=triton_gemv.Handoff(ready, span,
                                                             triton_gemv.HANDOFF_AWAIT.value),
                                 partials=partials)
    counters.pending = False
    return result
