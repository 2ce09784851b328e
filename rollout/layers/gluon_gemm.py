"""The decode-batch GEMMs as a warp-specialized Gluon kernel (Hopper only: TMA, wgmma,
mbarriers), for triton_gemv's table entries with `Config.gluon`: the fused gate/up + SiLU, or a
plain projection split along K (its fp32 partials summed by their reader, as triton_gemv's).

Why: at 128 rows the gate/up GEMM's tensor cores take about as long as its weight read
(forty-second session: its MMAs alone 13.6 µs, the weights 12.9 µs at the copy bandwidth), so
the two must overlap, which Triton's `tl` loop does only in part and its automatic warp
specialization got wrong. Here one producer warp issues the TMA loads into a ring of
shared-memory stages (`ready` / `empty` mbarriers) while the consumer warpgroups issue the
wgmmas and keep one K chunk's MMAs in flight. x's rows go on wgmma's M side (64 a warpgroup)
and the weight rows on N, which takes any multiple of 8 up to 256: a program's tile is a power
of two of weight rows (gate and up rows when gated) plus `extra` more (`Config.block_n` = main +
extra), so that the tiles can match the SM count: Qwen2-1.5B's 8,960 gate rows in tiles of
64 + 8 make 125, one an SM of the H200's 132, where 64-row tiles make 140 (eight SMs run two).
TMA boxes and Triton tensors are powers of two, hence the extra rows' own box and sums.

Gated, a stage holds the tile's gate rows and then its up rows in one buffer, and one wgmma takes
both (one more the extra rows): a wgmma reads its x operand from shared memory, and the four a K
step had (gate, up and their extra rows) read x's tile four times. Forty-ninth session: the
batch-128 decode graph -0.75% in the engine A/B (benchmarks/ab_fortyninth_session.json); alone
the 128-row gate/up timed 18.6 µs (19.6-20.2 in the forty-third session's runs, on other
machines) and 22.2 under Nsight Compute (22.5 before): alone it waits on its stages, not on
shared memory.

PDL (rollout/triton_pdl.py): the producer issues the weight tiles of its first
`Config.preload` stages before its PDL wait (no kernel of the step writes the weights) and x's
after it; the consumers wait before their first MMA, so nothing is read or written early.

Rounding as triton_gemv's epilogue (gated: gate and up rounded to the dtype, then
silu(gate).to(dtype) · up with expf and the IEEE quotient; contraction off): the same bits as
cuBLAS + silu_and_mul wherever their fp32 sums agree. Gluon does not run under
TRITON_INTERPRET=1: the CPU specs cover the table, the dispatch and a compile for sm_90, the GPU
specs the kernel (tests/test_gluon_gemm.py). triton_gemv imports it only where `_gluon_runs`
says it can run."""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rollout.layers.gemv_launch import Config, split_k_range
from rollout.layers.split_sum import SplitSum
from rollout.triton_pdl import EARLY_TRIGGER, launch_options

# Triton 3.6 (the H200's, pinned by its torch) names the TMA load async_copy_global_to_shared;
# later releases async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_weights(w_desc, e_desc, w_buf, e_buf, bar, off_n, N, k, MAIN: gl.constexpr,
                  EXTRA: gl.constexpr, GATED: gl.constexpr):
    """One K chunk of the tile's weight rows into a stage: its main rows, gated the gate rows
    then the up rows in one buffer (one wgmma takes both); the extra rows likewise."""
    if GATED:
        _tma_load(w_desc, [off_n, k], bar, w_buf.slice(0, MAIN))
        _tma_load(w_desc, [N + off_n, k], bar, w_buf.slice(MAIN, MAIN))
    else:
        _tma_load(w_desc, [off_n, k], bar, w_buf)
    if EXTRA > 0:
        if GATED:
            _tma_load(e_desc, [off_n + MAIN, k], bar, e_buf.slice(0, EXTRA))
            _tma_load(e_desc, [N + off_n + MAIN, k], bar, e_buf.slice(EXTRA, EXTRA))
        else:
            _tma_load(e_desc, [off_n + MAIN, k], bar, e_buf)


@gluon.jit
def _producer(x_desc, w_desc, e_desc, x_bufs, w_bufs, e_bufs, ready, empty, off_m, off_n,
              k_start, N, num_k, BK: gl.constexpr, MAIN: gl.constexpr,
              EXTRA: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr,
              PRELOAD: gl.constexpr, USE_PDL: gl.constexpr):
    """The loading warp: chunk i into stage i % STAGES once the consumers freed it; the first
    PRELOAD chunks' weight tiles before the PDL wait, x's after it."""
    halves: gl.constexpr = 2 if GATED else 1
    nbytes: gl.constexpr = x_desc.block_type.nbytes + halves * w_desc.block_type.nbytes + \
        (halves * e_desc.block_type.nbytes if EXTRA > 0 else 0)
    if USE_PDL == EARLY_TRIGGER:
        _gdc_launch_dependents()
    for i in gl.static_range(PRELOAD):  # PRELOAD <= STAGES and <= num_k (_launch_args)
        mbarrier.expect(ready.index(i), nbytes)
        _load_weights(w_desc, e_desc, w_bufs.index(i), e_bufs.index(i), ready.index(i), off_n,
                      N, k_start + i * BK, MAIN, EXTRA, GATED)
    if USE_PDL:
        _gdc_wait()
        if USE_PDL != EARLY_TRIGGER:
            _gdc_launch_dependents()
    for i in gl.static_range(PRELOAD):
        _tma_load(x_desc, [off_m, k_start + i * BK], ready.index(i), x_bufs.index(i))
    for i in range(PRELOAD, num_k):
        s = i % STAGES
        # use j of a stage waits for the consumers' release of use j - 1 (none for j = 0)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
        mbarrier.expect(ready.index(s), nbytes)
        k = k_start + i * BK
        _tma_load(x_desc, [off_m, k], ready.index(s), x_bufs.index(s))
        _load_weights(w_desc, e_desc, w_bufs.index(s), e_bufs.index(s), ready.index(s), off_n,
                      N, k, MAIN, EXTRA, GATED)


@gluon.jit
def _store(acc, acc_up, Y, P, M, N, stride_ym, pid_k, offs_m, offs_n, GATED: gl.constexpr,
           SPLIT: gl.constexpr):
    """A tile's fp32 sums out: silu(gate) · up rounded as triton_gemv's gated epilogue; or the
    sums rounded to the dtype; or, split along K, fp32 partials [SPLIT, M, N] for their reader
    to sum in split order (triton_gemv.finish_split)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT > 1:
        gl.store(P + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
    else:
        dt: gl.constexpr = Y.dtype.element_ty
        if GATED:
            gate = acc.to(dt).to(gl.float32)
            up = acc_up.to(dt).to(gl.float32)
            silu = gl.div_rn(gate, 1.0 + libdevice.exp(-gate)).to(dt).to(gl.float32)
            out = (silu * up).to(dt)
        else:
            out = acc.to(dt)
        gl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=mask)


@gluon.jit
def _mma_chunk(xs, w_buf, e_buf, acc_w, acc_e, EXTRA: gl.constexpr, OUTSTANDING: gl.constexpr):
    """One K chunk's MMAs issued (gated: gate and up rows in one wgmma, which reads x's tile
    from shared memory once for both), then a wait until OUTSTANDING chunks' MMAs are in
    flight."""
    acc_w = warpgroup_mma(xs, w_buf.permute((1, 0)), acc_w, is_async=True)
    if EXTRA > 0:
        acc_e = warpgroup_mma(xs, e_buf.permute((1, 0)), acc_e, is_async=True)
    return _mma_wait(acc_w, acc_e, EXTRA, OUTSTANDING)


@gluon.jit
def _mma_wait(acc_w, acc_e, EXTRA: gl.constexpr, OUTSTANDING: gl.constexpr):
    """warpgroup_mma_wait over the live accumulators (one MMA each a chunk)."""
    if EXTRA > 0:
        acc_w, acc_e = warpgroup_mma_wait(num_outstanding=2 * OUTSTANDING, deps=(acc_w, acc_e))
    else:
        acc_w = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc_w,))
    return acc_w, acc_e


@gluon.jit
def _unmerge(acc, layout: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
             GATED: gl.constexpr):
    """(gate, up) sums [ROWS, COLS] of a gated accumulator [ROWS, 2 COLS] (gate columns, then
    up columns) in `layout`, the MMA layout of COLS columns: a thread of the wide MMA holds
    column c and c + COLS, so the split moves no data. Not gated: (acc, acc)."""
    if GATED:
        gate, up = gl.split(gl.permute(gl.reshape(acc, [ROWS, 2, COLS]), (0, 2, 1)))
        first = gl.convert_layout(gate, layout, assert_trivial=True)
        second = gl.convert_layout(up, layout, assert_trivial=True)
    else:
        first = acc
        second = acc
    return first, second


@gluon.jit
def _consumer(x_bufs, w_bufs, e_bufs, ready, empty, Y, P, M, N, stride_ym, off_m, off_n, pid_k,
              num_k, BM: gl.constexpr, MAIN: gl.constexpr, EXTRA: gl.constexpr,
              GATED: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
              WARPS: gl.constexpr, USE_PDL: gl.constexpr):
    """The MMA warpgroups: the tile's sums over its K range, one chunk's MMAs in flight, each
    stage freed once its MMAs retired; then the epilogue."""
    halves: gl.constexpr = 2 if GATED else 1
    ew: gl.constexpr = EXTRA if EXTRA > 0 else 8
    main: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, MAIN, 16])
    side: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, ew, 16])
    wide: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, halves * MAIN, 16])
    wide_side: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                        warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, halves * ew, 16])
    if USE_PDL:
        _gdc_wait()  # the rule of triton_pdl: no write before the wait (x comes after it anyway)
    acc_w = gl.zeros([BM, halves * MAIN], gl.float32, wide)
    acc_e = gl.zeros([BM, halves * ew], gl.float32, wide_side)
    for i in range(num_k):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc_w, acc_e = _mma_chunk(x_bufs.index(s), w_bufs.index(s), e_bufs.index(s), acc_w,
                                  acc_e, EXTRA, 1)
        # this chunk's MMAs may still run; the previous chunk's have retired: free its stage
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
    acc_w, acc_e = _mma_wait(acc_w, acc_e, EXTRA, 0)
    acc, acc_up = _unmerge(acc_w, main, BM, MAIN, GATED)
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, main))
    offs_n = off_n + gl.arange(0, MAIN, layout=gl.SliceLayout(0, main))
    _store(acc, acc_up, Y, P, M, N, stride_ym, pid_k, offs_m, offs_n, GATED, SPLIT)
    if EXTRA > 0:
        acc, acc_up = _unmerge(acc_e, side, BM, ew, GATED)
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, side))
        offs_n = off_n + MAIN + gl.arange(0, EXTRA, layout=gl.SliceLayout(0, side))
        _store(acc, acc_up, Y, P, M, N, stride_ym, pid_k, offs_m, offs_n, GATED, SPLIT)


@gluon.jit(do_not_specialize=["M"])
def _gemm_kernel(x_desc, w_desc, e_desc, Y, P, M, N, K, K_SPLIT, stride_ym, BM: gl.constexpr,
                 MAIN: gl.constexpr, EXTRA: gl.constexpr, BK: gl.constexpr,
                 GATED: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
                 PRELOAD: gl.constexpr, WARPS: gl.constexpr, USE_PDL: gl.constexpr):
    """A program a tile of BM x rows x (MAIN + EXTRA) weight rows (gate and up rows when gated)
    over K range program_id(1) (K_SPLIT a split), M blocks innermost."""
    blocks_m = gl.cdiv(M, BM)
    off_m = (gl.program_id(0) % blocks_m) * BM
    off_n = (gl.program_id(0) // blocks_m) * (MAIN + EXTRA)
    pid_k = gl.program_id(1)
    k_start = pid_k * K_SPLIT
    num_k = gl.cdiv(gl.minimum(K - k_start, K_SPLIT), BK)
    ew: gl.constexpr = EXTRA if EXTRA > 0 else 8
    halves: gl.constexpr = 2 if GATED else 1  # gated: gate rows then up rows in one buffer
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, halves * MAIN, BK],
                                       w_desc.layout)
    e_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, halves * ew, BK], e_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [(_consumer, (x_bufs, w_bufs, e_bufs, ready, empty, Y, P, M, N, stride_ym, off_m,
                      off_n, pid_k, num_k, BM, MAIN, EXTRA, GATED, SPLIT, STAGES, WARPS,
                      USE_PDL)),
         (_producer, (x_desc, w_desc, e_desc, x_bufs, w_bufs, e_bufs, ready, empty, off_m,
                      off_n, k_start, N, num_k, BK, MAIN, EXTRA, GATED, STAGES, PRELOAD,
                      USE_PDL))],
        [1], [40])


def tile_rows(cfg: Config) -> tuple[int, int]:
    """A program's weight rows (`Config.block_n`) as its main tile, a power of two >= 64, and
    the extra rows past it, 0 or a power of two >= 8 (72 = 64 + 8, 128 = 128 + 0); a ValueError
    for a block_n the kernel cannot tile."""
    main = 1 << (cfg.block_n.bit_length() - 1) if cfg.block_n > 0 else 0
    extra = cfg.block_n - main
    if main < 64 or main > 256 or (extra and (extra < 8 or extra & (extra - 1))):
        raise ValueError(f"block_n={cfg.block_n}: the Gluon GEMM tiles a power of two of 64 to "
                         "256 rows plus 0 or a power of two >= 8")
    return main, extra


@functools.lru_cache(maxsize=None)
def _layout(rows: int, cols: int) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _launch_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool,
                 cfg: Config, use_pdl=None, has_bias: bool = False) -> tuple:
    """(grid, arguments, keywords, partials, split) of a launch, or a ValueError for one the
    kernel cannot run; `use_pdl` overrides the PDL mode (compile_for_sm90)."""
    from rollout.layers.triton_gemv import split_partials
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    main, extra = tile_rows(cfg)
    split, k_split = split_k_range(K, cfg)
    last_chunks = triton.cdiv(K - (split - 1) * k_split, cfg.block_k)  # the shortest range's
    # the producer issues PRELOAD chunks unconditionally: no more than every range holds
    preload = min(cfg.preload, cfg.num_stages, last_chunks)
    bm = cfg.block_m
    if x.dtype != torch.bfloat16 or bm not in (64, 128) or cfg.num_warps * 16 > bm \
            or cfg.num_warps not in (4, 8) or (gated and split > 1) or last_chunks < 1:
        raise ValueError(f"the Gluon GEMM takes bf16 x, tiles of 64 or 128 x rows, 4 or 8 "
                         f"consumer warps (16 rows a warp at least), no K split when gated and "
                         f"no empty K range: {x.dtype}, block_m {bm}, {cfg.num_warps} warps, "
                         f"split {split} of {k_split} columns for K = {K}")
    if gated and main > 128:
        raise ValueError(f"block_n={cfg.block_n}: gated, the Gluon GEMM's gate and up rows "
                         "share one wgmma, 256 columns at most (a main tile of 128 rows)")
    if has_bias and split == 1:
        raise ValueError("the Gluon GEMM takes a bias only split along K (its partials' sum "
                         "adds it; the epilogue has none)")
    partials = split_partials(M, N, gated, split, out)
    ew = extra or 8
    descs = [TensorDescriptor.from_tensor(t, [rows, cfg.block_k], _layout(rows, cfg.block_k))
             for t, rows in ((x, bm), (weight, main), (weight, ew))]
    pdl = launch_options(preloads_weights=preload > 0) if use_pdl is None else {
        "USE_PDL": use_pdl}
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, cfg.block_n), split)
    meta = dict(BM=bm, MAIN=main, EXTRA=extra, BK=cfg.block_k, GATED=gated, SPLIT=split,
                STAGES=cfg.num_stages, PRELOAD=preload, WARPS=cfg.num_warps,
                num_warps=cfg.num_warps, enable_fp_fusion=False, **pdl)
    return grid, (*descs, out, partials, M, N, K, k_split, out.stride(0)), meta, partials, split


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool, cfg: Config,
           defer_split: bool = False,
           bias: Optional[torch.Tensor] = None) -> Union[torch.Tensor, SplitSum]:
    """out = x @ weight.T (+ bias), or silu(gate) · up of the fused [gate | up] weight; bf16,
    16-byte aligned rows (triton_gemv checked the shapes and the GPU). x's rows in tiles of
    `Config.block_m` (64: one consumer warpgroup; 128: one or two), zero-filled past M; split
    along K (`Config.split_k`, not gated) into fp32 partials summed by triton_gemv's reduce
    kernel or, with `defer_split`, by their reader. A bias only with a split: whoever sums the
    partials adds it (the kernel's epilogue has none)."""
    from rollout.layers.triton_gemv import finish_split
    grid, args, meta, partials, split = _launch_args(x, weight, out, gated, cfg,
                                                     has_bias=bias is not None)
    _gemm_kernel[grid](*args, **meta)
    return finish_split(partials, bias, out, gated, split, defer_split)


def compile_for_sm90(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool,
                     cfg: Config, use_pdl: int):
    """The kernel of a launch compiled, not run (the active Triton driver names the target:
    tests.helpers.H200CompileTarget on a machine without a GPU); returns the compiled kernel."""
    grid, args, meta, _, _ = _launch_args(x, weight, out, gated, cfg, use_pdl)
    return _gemm_kernel.warmup(*args, grid=grid, **meta)
