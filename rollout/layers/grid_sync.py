"""Synchronisation between the programs of one Triton launch (a persistent kernel's phases).

A persistent kernel runs every program at once (its grid fits on the GPU: the launcher checks
occupancy) and orders its phases with counters in global memory instead of kernel boundaries:
`grid_barrier` holds each program until all have arrived (the counter has reached
`target` = programs × barriers so far), `arrive` counts a program in and says whether it was
the last of `expected` (the last one finishes the work, e.g. merges the others' partials).

Memory ordering (PTX's model): each program's threads meet at a CTA barrier after their
stores, then one thread adds with release semantics at GPU scope; a waiter's acquire at GPU
scope after seeing the count makes every store before every arrival visible to its loads.
Readers of another program's data still load with `.cg` (L2, never a stale L1 line).

Counters are never reset inside a launch: the caller zeroes them before the launch that uses
them. The spin needs every program resident at once: a persistent grid only, never under the
CPU interpreter (which runs programs one after another); split the phases into launches there."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def arrive(counter, expected):
    """Count this program in at `counter` (int32); True in the program that arrived last of
    `expected`. Release: its earlier stores are visible to whoever sees the count; acquire:
    the last one sees every other arriver's stores."""
    tl.debug_barrier()  # every thread's stores are issued before the count
    before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    return before == expected - 1


@triton.jit
def grid_barrier(counter, target, THREADS: tl.constexpr):
    """Arrive at `counter`, then wait until `target` programs have, then acquire. One thread of
    the program polls (a volatile load, not an atomic, so the waiters do not queue behind the
    arrivals; one load a program a round, not one a warp) and the CTA barrier of the max hands
    its answer to the others. THREADS: the program's thread count (32 · num_warps)."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    lane = tl.arange(0, THREADS)
    seen = tl.max(tl.load(counter + lane * 0, mask=lane == 0, other=0, volatile=True), 0)
    while seen < target:
        seen = tl.max(tl.load(counter + lane * 0, mask=lane == 0, other=0, volatile=True), 0)
    _fence_acq_rel(seen)
    tl.debug_barrier()


@triton.jit
def _fence_acq_rel(x):
    """fence.acq_rel.gpu: after the poll saw the count, the waiter's later loads see every store
    released before the arrivals (an `atomic_add(counter, 0)` with acquire would do, but its
    unused result lets the compiler drop it)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [x],
                                     dtype=tl.int32, is_pure=False, pack=1)
