"""Weights into L2 ahead of the GEMV that reads them, while the decode step's short kernels run.

A small-batch decode step alternates between kernels that stream weights from HBM (the four
projections) and kernels that barely touch memory (rotary, the attention split and merge, the
norms): during the latter the memory system idles. `LayerPrefetch` issues, right after a layer's
rotary kernel, bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, Hopper and newer) of the weights
that come next — the o projection's, then the first rows of the gate and up halves, then of the
down projection — up to a byte budget that fits the L2 cache. Those bytes then stream in under
the attention kernels, and the GEMVs that follow find them in L2.

The prefetch kernel reads no earlier kernel's output and writes nothing, so under PDL
(`triton_pdl`) it issues its prefetches before `griddepcontrol.wait`, and lets the next kernel
launch first thing; it waits (for its predecessor) only before it ends, which keeps completion
ordered along the stream — the rule the other kernels rely on. A prefetch is a hint: it changes
no value, only where the weights are read from.

Only on compiled CUDA kernels with compute capability >= 9 (`supported`); elsewhere
`LayerPrefetch.for_layer` returns None and the model runs as before."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 16384  # bytes per prefetch instruction (one thread issues one)
BLOCK = 32  # chunks per program, one per thread of its one warp: 512 KiB a program, many SMs
MAX_REGIONS = 4
_supported: Optional[bool] = None


class Region(NamedTuple):
    """`nbytes` bytes of `tensor`'s storage from byte `start` (both multiples of 16)."""

    tensor: torch.Tensor
    start: int
    nbytes: int


@triton.jit
def _prefetch_chunks(base, start, nbytes, cid, CHUNK: tl.constexpr):
    """One bulk L2 prefetch per chunk id `cid` of the region (ids past its end: none)."""
    off = cid.to(tl.int64) * CHUNK
    valid = (off < nbytes).to(tl.int32)
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
    addr = base.to(tl.int64) + start + off
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, valid], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(P0, S0, N0, P1, S1, N1, P2, S2, N2, P3, S3, N3,
                        NUM_REGIONS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may launch at once: nothing here is its input
        tl.extra.cuda.gdc_launch_dependents()
    cid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    region = tl.program_id(1)
    if region == 0:
        _prefetch_chunks(P0, S0, N0, cid, CHUNK)
    if NUM_REGIONS > 1 and region == 1:
        _prefetch_chunks(P1, S1, N1, cid, CHUNK)
    if NUM_REGIONS > 2 and region == 2:
        _prefetch_chunks(P2, S2, N2, cid, CHUNK)
    if NUM_REGIONS > 3 and region == 3:
        _prefetch_chunks(P3, S3, N3, cid, CHUNK)
    if USE_PDL:  # end after the predecessor: completion stays ordered along the stream
        tl.extra.cuda.gdc_wait()


def supported(device: torch.device) -> bool:
    """Compiled Triton on a CUDA GPU of compute capability >= 9 (the bulk prefetch is sm_90+)."""
    global _supported
    if device.type != "cuda":
        return False
    if _supported is None:
        _supported = (os.environ.get("TRITON_INTERPRET", "0") != "1"
                      and torch.cuda.get_device_capability(device) >= (9, 0))
    return _supported


def prefetch(regions: Sequence[Region]) -> None:
    """Launch one kernel that prefetches every region into L2 (1 to MAX_REGIONS of them)."""
    from rollout.triton_pdl import launch_options  # same PDL switch as the other kernels
    if not 1 <= len(regions) <= MAX_REGIONS:
        raise ValueError(f"{len(regions)} regions: one launch takes 1 to {MAX_REGIONS}")
    padded = list(regions) + [regions[0]] * (MAX_REGIONS - len(regions))
    args = []
    for r in padded:
        args += [r.tensor, r.start, r.nbytes]
    programs = triton.cdiv(max(triton.cdiv(r.nbytes, CHUNK_BYTES) for r in regions), BLOCK)
    opts = launch_options()
    opts.pop("USE_PDL", None)
    _l2_prefetch_kernel[(programs, len(regions))](
        *args, NUM_REGIONS=len(regions), CHUNK=CHUNK_BYTES, BLOCK=BLOCK,
        USE_PDL=bool(opts), num_warps=max(1, BLOCK // 32), **opts)


def plan(weights: Sequence[tuple[torch.Tensor, int]], budget_bytes: int) -> list[Region]:
    """Regions covering, in order, the leading rows of each (weight, parts) until `budget_bytes`
    is spent: a weight of `parts` row blocks (2 for the fused [gate | up]: a GEMV program reads
    row j of both halves) gets the same number of leading rows from each part. Sizes are rounded
    down to 16 bytes (the instruction's unit); a weight needs a 16-byte aligned storage."""
    regions: list[Region] = []
    left = budget_bytes
    for w, parts in weights:
        if left < 16 * parts or w.numel() == 0:
            break
        rows, row_bytes = w.shape[0] // parts, w[0].numel() * w.element_size()
        part_bytes = rows * row_bytes
        take = min(part_bytes, left // parts) // 16 * 16
        for p in range(parts):
            regions.append(Region(w, p * part_bytes, take))
        left -= take * parts
    return [r for r in regions if r.nbytes > 0]


class LayerPrefetch:
    """A decoder layer's prefetch after its rotary kernel: the o projection's weight, then the
    leading rows of gate/up (both halves) and of down, `budget_bytes` in all."""

    def __init__(self, regions: list[Region]):
        self.regions = regions

    @classmethod
    def for_layer(cls, o_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                  down_weight: torch.Tensor, budget_bytes: int) -> Optional["LayerPrefetch"]:
        if budget_bytes <= 0 or not supported(o_weight.device):
            return None
        if any(w.data_ptr() % 16 or not w.is_contiguous()
               for w in (o_weight, gate_up_weight, down_weight)):
            return None
        regions = plan([(o_weight, 1), (gate_up_weight, 2), (down_weight, 1)], budget_bytes)
        if not regions:
            return None
        return cls(regions[:MAX_REGIONS])

    def __call__(self) -> None:
        prefetch(self.regions)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)
