"""The fused gate/up + SiLU at decode batches of 65-128 rows as a warp-specialized Gluon kernel
(Hopper only: TMA, wgmma, mbarriers), `Config.gluon` in triton_gemv's table.

Why: at 128 rows the gate/up GEMM's tensor cores take about as long as its weight read
(forty-second session: its MMAs alone 13.6 µs, the weights 12.9 µs at the copy bandwidth), so
the two must overlap, which Triton's `tl` loop does only in part and its automatic warp
specialization got wrong. Here one producer warp issues the TMA loads into a ring of
shared-memory stages (`ready` / `empty` mbarriers) while the consumer warpgroups issue the
wgmmas and keep one K chunk's MMAs in flight. x's rows go on wgmma's M side (64 a warpgroup)
and the weight rows on N, which takes any multiple of 8: a program's tile is 64 gate and 64 up
rows plus `extra` more of each (`Config.block_n` = 64 + extra), so that Qwen2-1.5B's 8,960
rows make 125 tiles, one an SM of the H200's 132, where 64-row tiles make 140 (eight SMs run
two). TMA boxes and Triton tensors are powers of two, hence the extra rows' own box and sums.

PDL (rollout/triton_pdl.py): the producer issues the weight tiles of its first
`Config.preload` stages before its PDL wait (no kernel of the step writes the weights) and x's
after it; the consumers wait before their first MMA, so nothing is read or written early.

Rounding as triton_gemv's gated epilogue (gate and up rounded to the dtype, then
silu(gate).to(dtype) · up with expf and the IEEE quotient; contraction off): the same bits as
cuBLAS + silu_and_mul wherever their fp32 sums agree. Gluon does not run under
TRITON_INTERPRET=1: the CPU specs cover the table, the dispatch and a compile for sm_90, the GPU
specs the kernel (tests/test_gluon_gate_up.py). triton_gemv imports it only where `_gluon_runs`
says it can run."""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rollout.layers.gemv_launch import Config
from rollout.triton_pdl import EARLY_TRIGGER, launch_options

# Triton 3.6 (the H200's, pinned by its torch) names the TMA load async_copy_global_to_shared;
# later releases async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
MAIN_N = gl.constexpr(64)  # weight rows a program, before the extra ones


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_weights(w_desc, e_desc, g_buf, u_buf, eg_buf, eu_buf, bar, off_n, inter, k,
                  EXTRA: gl.constexpr):
    """One K chunk of the tile's gate and up rows (and extra rows) into a stage."""
    _tma_load(w_desc, [off_n, k], bar, g_buf)
    _tma_load(w_desc, [inter + off_n, k], bar, u_buf)
    if EXTRA > 0:
        _tma_load(e_desc, [off_n + MAIN_N, k], bar, eg_buf)
        _tma_load(e_desc, [inter + off_n + MAIN_N, k], bar, eu_buf)


@gluon.jit
def _producer(x_desc, w_desc, e_desc, x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready, empty,
              off_m, off_n, inter, num_k, BK: gl.constexpr, EXTRA: gl.constexpr,
              STAGES: gl.constexpr, PRELOAD: gl.constexpr, USE_PDL: gl.constexpr):
    """The loading warp: chunk i into stage i % STAGES once the consumers freed it; the first
    PRELOAD chunks' weight tiles before the PDL wait, x's after it."""
    nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes + \
        (2 * e_desc.block_type.nbytes if EXTRA > 0 else 0)
    if USE_PDL == EARLY_TRIGGER:
        _gdc_launch_dependents()
    for i in gl.static_range(PRELOAD):  # PRELOAD <= STAGES and <= num_k (the launcher's check)
        mbarrier.expect(ready.index(i), nbytes)
        _load_weights(w_desc, e_desc, g_bufs.index(i), u_bufs.index(i), eg_bufs.index(i),
                      eu_bufs.index(i), ready.index(i), off_n, inter, i * BK, EXTRA)
    if USE_PDL:
        _gdc_wait()
        if USE_PDL != EARLY_TRIGGER:
            _gdc_launch_dependents()
    for i in gl.static_range(PRELOAD):
        _tma_load(x_desc, [off_m, i * BK], ready.index(i), x_bufs.index(i))
    for i in range(PRELOAD, num_k):
        s = i % STAGES
        # use j of a stage waits for the consumers' release of use j - 1 (none for j = 0)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
        mbarrier.expect(ready.index(s), nbytes)
        _tma_load(x_desc, [off_m, i * BK], ready.index(s), x_bufs.index(s))
        _load_weights(w_desc, e_desc, g_bufs.index(s), u_bufs.index(s), eg_bufs.index(s),
                      eu_bufs.index(s), ready.index(s), off_n, inter, i * BK, EXTRA)


@gluon.jit
def _silu_store(gate, up, Y, M, inter, stride_ym, offs_m, offs_n):
    """silu(gate) · up of fp32 sums, rounded as triton_gemv's gated epilogue."""
    dt: gl.constexpr = Y.dtype.element_ty
    gate = gate.to(dt).to(gl.float32)
    up = up.to(dt).to(gl.float32)
    silu = gl.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(dt).to(gl.float32)
    gl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], (silu * up).to(dt),
             mask=(offs_m < M)[:, None] & (offs_n < inter)[None, :])


@gluon.jit
def _consumer(x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready, empty, Y, M, inter, stride_ym,
              off_m, off_n, num_k, BM: gl.constexpr, EXTRA: gl.constexpr,
              STAGES: gl.constexpr, WARPS: gl.constexpr, USE_PDL: gl.constexpr):
    """The MMA warpgroups: the tile's sums over K, one chunk's MMAs in flight, each stage freed
    once its MMAs retired; then the SiLU epilogue."""
    main: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, MAIN_N, 16])
    side: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, EXTRA if EXTRA > 0 else 8, 16])
    ew: gl.constexpr = EXTRA if EXTRA > 0 else 8
    if USE_PDL:
        _gdc_wait()  # the rule of triton_pdl: no write before the wait (x comes after it anyway)
    acc_g = gl.zeros([BM, MAIN_N], gl.float32, main)
    acc_u = gl.zeros([BM, MAIN_N], gl.float32, main)
    acc_eg = gl.zeros([BM, ew], gl.float32, side)
    acc_eu = gl.zeros([BM, ew], gl.float32, side)
    for i in range(num_k):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        xs = x_bufs.index(s)
        acc_g = warpgroup_mma(xs, g_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
        acc_u = warpgroup_mma(xs, u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
        if EXTRA > 0:
            acc_eg = warpgroup_mma(xs, eg_bufs.index(s).permute((1, 0)), acc_eg, is_async=True)
            acc_eu = warpgroup_mma(xs, eu_bufs.index(s).permute((1, 0)), acc_eu, is_async=True)
            acc_g, acc_u, acc_eg, acc_eu = warpgroup_mma_wait(
                num_outstanding=4, deps=(acc_g, acc_u, acc_eg, acc_eu))
        else:
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
        # this chunk's MMAs may still run; the previous chunk's have retired: free its stage
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
    acc_g, acc_u, acc_eg, acc_eu = warpgroup_mma_wait(num_outstanding=0,
                                                      deps=(acc_g, acc_u, acc_eg, acc_eu))
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, main))
    offs_n = off_n + gl.arange(0, MAIN_N, layout=gl.SliceLayout(0, main))
    _silu_store(acc_g, acc_u, Y, M, inter, stride_ym, offs_m, offs_n)
    if EXTRA > 0:
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, side))
        offs_n = off_n + MAIN_N + gl.arange(0, EXTRA, layout=gl.SliceLayout(0, side))
        _silu_store(acc_eg, acc_eu, Y, M, inter, stride_ym, offs_m, offs_n)


@gluon.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(x_desc, w_desc, e_desc, Y, M, inter, K, stride_ym, BM: gl.constexpr,
                         EXTRA: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                         PRELOAD: gl.constexpr, WARPS: gl.constexpr, USE_PDL: gl.constexpr):
    """A program a tile of BM x rows x (64 + EXTRA) gate and up rows, M blocks innermost."""
    blocks_m = gl.cdiv(M, BM)
    off_m = (gl.program_id(0) % blocks_m) * BM
    off_n = (gl.program_id(0) // blocks_m) * (MAIN_N + EXTRA)
    num_k = gl.cdiv(K, BK)
    ew: gl.constexpr = EXTRA if EXTRA > 0 else 8
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    g_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, MAIN_N, BK], w_desc.layout)
    u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, MAIN_N, BK], w_desc.layout)
    eg_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, ew, BK], e_desc.layout)
    eu_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, ew, BK], e_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [(_consumer, (x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready, empty, Y, M, inter,
                      stride_ym, off_m, off_n, num_k, BM, EXTRA, STAGES, WARPS, USE_PDL)),
         (_producer, (x_desc, w_desc, e_desc, x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready,
                      empty, off_m, off_n, inter, num_k, BK, EXTRA, STAGES, PRELOAD, USE_PDL))],
        [1], [40])


def extra_rows(cfg: Config) -> int:
    """The weight rows a program takes past the 64 of its main tile (0, 8, 16, ...: a power of
    two), from `Config.block_n`; a ValueError for a block_n the kernel cannot tile."""
    extra = cfg.block_n - MAIN_N.value
    if extra < 0 or (extra and (extra < 8 or extra & (extra - 1))):
        raise ValueError(f"block_n={cfg.block_n}: the Gluon gate/up tiles 64 rows plus 0 or a "
                         "power of two >= 8")
    return extra


@functools.lru_cache(maxsize=None)
def _layout(rows: int, cols: int) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _launch_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: Config,
                 use_pdl=None) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, keywords) of a launch; `use_pdl` overrides the PDL mode
    (compile_for_sm90)."""
    M, K = x.shape
    inter = weight.shape[0] // 2
    extra = extra_rows(cfg)
    preload = min(cfg.preload, cfg.num_stages, triton.cdiv(K, cfg.block_k))
    bm = cfg.block_m
    if x.dtype != torch.bfloat16 or bm not in (64, 128) or cfg.num_warps * 16 > bm \
            or cfg.num_warps not in (4, 8):
        raise ValueError(f"the Gluon gate/up takes bf16 x, tiles of 64 or 128 x rows and 4 or 8 "
                         f"consumer warps (16 rows a warp at least): {x.dtype}, block_m {bm}, "
                         f"{cfg.num_warps} warps")
    descs = [TensorDescriptor.from_tensor(t, [rows, cfg.block_k], _layout(rows, cfg.block_k))
             for t, rows in ((x, bm), (weight, MAIN_N.value), (weight, extra or 8))]
    pdl = (launch_options(preloads_weights=preload > 0) if use_pdl is None
           else {"USE_PDL": use_pdl})
    grid = (triton.cdiv(M, bm) * triton.cdiv(inter, cfg.block_n),)
    meta = dict(BM=bm, EXTRA=extra, BK=cfg.block_k, STAGES=cfg.num_stages, PRELOAD=preload,
                WARPS=cfg.num_warps, num_warps=cfg.num_warps, enable_fp_fusion=False, **pdl)
    return grid, (*descs, out, M, inter, K, out.stride(0)), meta


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: Config) -> torch.Tensor:
    """out [M, inter] = silu(x @ gate.T) · (x @ up.T) for the fused [gate | up] weight; bf16,
    16-byte aligned rows (triton_gemv checked the shapes and the GPU). x's rows in tiles of
    `Config.block_m` (64: one consumer warpgroup; 128: one or two), zero-filled past M."""
    grid, args, meta = _launch_args(x, weight, out, cfg)
    _gate_up_silu_kernel[grid](*args, **meta)
    return out


def compile_for_sm90(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: Config,
                     use_pdl: int):
    """The kernel `launch` would run, compiled and not run (the active Triton driver names the
    target: tests.helpers.H200CompileTarget on a machine without a GPU)."""
    grid, args, meta = _launch_args(x, weight, out, cfg, use_pdl)
    return _gate_up_silu_kernel.warmup(*args, grid=grid, **meta)
