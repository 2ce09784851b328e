"""The one-row fused gate/up + SiLU as a Gluon kernel whose weight stream starts before its PDL
wait, into a ring of shared memory filled by TMA (Hopper).

Why: at batch 1 a decoder layer's weight bytes stream only inside its GEMVs; between them a chain
of latency-bound kernels (norm, qkv, attention, o, norm) leaves HBM idle for ~10 µs a layer. The
Triton GEMV (triton_gemv) loads its first K chunks into registers before its PDL wait, but only
its resident programs do, and registers bound how much (~8 KB a program). Here each program owns
a fixed share of the rows (one program per SM, or a few) and issues TMA copies of its first
STAGES row groups (up to ~200 KB an SM) before the wait, so a larger share of gate/up's 55 MB is
already on chip when its input is ready; the rest streams through the same ring after it.

Experimental (ROLLOUT_GLUON_GATE_UP, off by default): Gluon does not run under the CPU
interpreter, so its spec is GPU-only (tests/test_gluon_gate_up.py).

Rounding: products and sums in fp32 (another order than the Triton kernel), gate and up each
rounded to the dtype, then silu(gate).to(dtype) * up as triton_ops.silu_and_mul."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch

from rollout import triton_pdl

KC = 256  # K columns a TMA box carries (a box dimension holds at most 256 elements)


@dataclasses.dataclass(frozen=True)
class GluonGateUpConfig:
    rows: int = 4          # gate (and up) rows a ring slot holds: one group
    stages: int = 8        # ring slots; all issued before the PDL wait
    warps: int = 4
    programs_per_sm: int = 1
    trigger_late: bool = False  # let the next kernel launch at the end instead of after the wait

    def __post_init__(self) -> None:
        for name in ("rows", "warps"):  # tensor shapes and warp counts
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GluonGateUpConfig.{name}={v}: want a power of 2")
        if self.rows < self.warps:
            raise ValueError(f"GluonGateUpConfig: {self.warps} warps for {self.rows} rows (a warp "
                             "holds whole rows)")
        for name in ("stages", "programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"GluonGateUpConfig.{name}={getattr(self, name)}: want >= 1")

    def smem_bytes(self, k: int) -> int:
        return self.stages * 2 * self.rows * k * 2


def config_from_env() -> Optional[GluonGateUpConfig]:
    """ROLLOUT_GLUON_GATE_UP: unset/"0" off; "1" the default config; "rows,stages,warps,
    programs_per_sm,trigger_late" a config."""
    spec = os.environ.get("ROLLOUT_GLUON_GATE_UP", "0")
    if spec in ("", "0"):
        return None
    if spec == "1":
        return GluonGateUpConfig()
    r, s, w, p, t = (int(v) for v in spec.split(","))
    return GluonGateUpConfig(r, s, w, p, bool(t))


def supports(x: torch.Tensor, weight: torch.Tensor, inter: int,
             config: GluonGateUpConfig) -> bool:
    k = x.shape[-1]
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and x.dtype == torch.bfloat16
            and weight.dtype == x.dtype and weight.is_contiguous() and weight.shape[1] == k
            and k % KC == 0 and inter % config.rows == 0 and weight.data_ptr() % 16 == 0
            and config.smem_bytes(k) <= 200 * 1024
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


@functools.lru_cache(maxsize=None)
def _kernel():
    """Built on first use: Gluon needs a GPU build of Triton."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.language.extra import libdevice
    import triton.language as tl

    @gluon.jit
    def _issue(desc, w_smem, bar, slot, row, NKC: gl.constexpr, KCOLS: gl.constexpr):
        """TMA copies of a group's gate and up rows (one box holds both) into ring slot `slot`."""
        mbarrier.expect(bar.index(slot), NKC * desc.block_type.nbytes)
        for c in gl.static_range(NKC):
            tma.async_copy_global_to_shared(desc, [0, row, c * KCOLS], bar.index(slot),
                                            w_smem.index(slot * NKC + c))

    @gluon.jit
    def gate_up_kernel(desc, X, Y, num_groups,
                       ROWS: gl.constexpr, NKC: gl.constexpr, KCOLS: gl.constexpr,
                       STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr,
                       TRIGGER_LATE: gl.constexpr):
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        my_groups = (num_groups - pid + nprog - 1) // nprog  # groups pid, pid + nprog, ...

        # [gate/up, rows, columns]: a warp holds whole rows (KCOLS / 32 columns a thread), both
        # halves in the same thread, so neither sum needs shared memory
        tile: gl.constexpr = gl.BlockedLayout([2, 1, KCOLS // 32], [1, 1, 32], [1, NUM_WARPS, 1],
                                              [2, 1, 0])
        sums_l: gl.constexpr = gl.SliceLayout(2, tile)
        half_l: gl.constexpr = gl.SliceLayout(1, sums_l)
        rows_l: gl.constexpr = gl.SliceLayout(0, sums_l)
        cols_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, tile))
        w_smem = gl.allocate_shared_memory(desc.dtype, [STAGES * NKC, 2, ROWS, KCOLS], desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bar.index(s), count=1)
        for s in gl.static_range(STAGES):
            if s < my_groups:
                _issue(desc, w_smem, bar, s, (pid + s * nprog) * ROWS, NKC, KCOLS)

        if USE_PDL:
            if not TRIGGER_LATE:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

        offs_c = gl.arange(0, KCOLS, layout=cols_l)
        offs_r = gl.arange(0, ROWS, layout=rows_l)
        is_gate = (gl.arange(0, 2, layout=half_l) == 0)[:, None]
        for i in range(my_groups):
            slot = i % STAGES
            mbarrier.wait(bar.index(slot), (i // STAGES) & 1)
            acc = gl.zeros([2, ROWS, KCOLS], gl.float32, tile)
            for c in gl.static_range(NKC):
                xc = gl.load(X + c * KCOLS + offs_c).to(gl.float32)[None, None, :]
                acc += w_smem.index(slot * NKC + c).load(tile).to(gl.float32) * xc
            gl.thread_barrier()  # every warp is done with the slot before TMA refills it
            nxt = i + STAGES
            if nxt < my_groups:
                _issue(desc, w_smem, bar, slot, (pid + nxt * nprog) * ROWS, NKC, KCOLS)
            sums = gl.sum(acc, axis=2)
            dt = Y.dtype.element_ty
            gate = gl.sum(gl.where(is_gate, sums, 0.0), axis=0).to(dt).to(gl.float32)
            up = gl.sum(gl.where(is_gate, 0.0, sums), axis=0).to(dt).to(gl.float32)
            e = libdevice.exp(-gate)
            silu = tl.math.div_rn(gate, 1.0 + e).to(dt).to(gl.float32)
            gl.store(Y + (pid + i * nprog) * ROWS + offs_r, (silu * up).to(dt))

        if USE_PDL:
            if TRIGGER_LATE:
                tl.extra.cuda.gdc_launch_dependents()
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bar.index(s))

    return gate_up_kernel


_descriptors: dict = {}  # (data_ptr, shape, rows) -> (weight, descriptor)


def _descriptor(weight: torch.Tensor, rows: int):
    """The weight's TMA descriptor (boxes of [gate, up] x rows x KC), made once per weight storage."""
    key = (weight.data_ptr(), tuple(weight.shape), rows)
    hit = _descriptors.get(key)
    if hit is None:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
        halves = weight.view(2, weight.shape[0] // 2, weight.shape[1])  # [gate | up]
        hit = _descriptors[key] = (weight, TensorDescriptor.from_tensor(halves, [2, rows, KC],
                                                                         layout))
    return hit[1]


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, inter: int,
                 config: GluonGateUpConfig, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for one row x [1, K], weight [2·inter, K]."""
    if not supports(x, weight, inter, config):
        raise ValueError(f"gluon gate/up: unsupported x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)}, inter {inter}, {config}")
    k = x.shape[1]
    if out is None:
        out = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    desc = _descriptor(weight, config.rows)
    num_groups = inter // config.rows
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(num_groups, sms * config.programs_per_sm),)
    opts = triton_pdl.launch_options(preloads_weights=True)
    _kernel()[grid](desc, x, out, num_groups, ROWS=config.rows, NKC=k // KC, KCOLS=KC,
                    STAGES=config.stages, NUM_WARPS=config.warps,
                    TRIGGER_LATE=config.trigger_late, num_warps=config.warps, **opts)
    return out
