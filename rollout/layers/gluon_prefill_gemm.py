"""A prefill chunk's gate/up + SiLU as a persistent warp-specialized Gluon GEMM (Hopper): the
decode batches' kernel (gluon_gemm.py) looping over output tiles, so that its producer warp
loads the next tile's first K chunks while the consumers finish a tile's epilogue.

Why: at thousands of rows cuBLAS's GEMM writes the [tokens, 2·inter] gate|up output and the
SiLU·mul kernel reads it back and writes half of it, ~6 ms of batch 128's ≈80 ms prefill at the
copy bandwidth. Writing silu(gate)·up from the GEMM's epilogue saves that kernel if the GEMM
keeps cuBLAS's pace; gluon_gemm's one-tile-a-program kernel measured 836 µs at 8,192 rows
against cuBLAS + SiLU's 848 and 402 against 385 at 4,096 (forty-seventh session,
benchmarks/gpu_prefill_gate_up.py), its pipeline refilled from empty at every tile.

A program per SM; tile t (M blocks innermost, as gluon_gemm's grid) goes to program
t mod programs. One ring of shared-memory stages serves every tile a program runs: chunk c of
the program (counted across its tiles) goes to stage c mod STAGES, so the producer's waits and
the consumers' phases carry over from tile to tile. Rounding as gluon_gemm's (the same
`_store`): bit for bit cuBLAS + silu_and_mul where their fp32 sums agree."""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rollout.layers.gemv_launch import Config
from rollout.layers.gluon_gemm import (_gdc_launch_dependents, _gdc_wait, _layout, _load_weights,
                                       _mma_chunk, _mma_wait, _store, _tma_load, tile_rows)


@gluon.jit
def _producer(x_desc, w_desc, e_desc, x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready, empty,
              M, N, K, BM: gl.constexpr, BK: gl.constexpr, MAIN: gl.constexpr,
              EXTRA: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr,
              USE_PDL: gl.constexpr):
    """The loading warp: the program's tiles' chunks in order into the ring."""
    halves: gl.constexpr = 2 if GATED else 1
    nbytes: gl.constexpr = x_desc.block_type.nbytes + halves * w_desc.block_type.nbytes + \
        (halves * e_desc.block_type.nbytes if EXTRA > 0 else 0)
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()
    blocks_m = gl.cdiv(M, BM)
    num_tiles = blocks_m * gl.cdiv(N, MAIN + EXTRA)
    num_k = gl.cdiv(K, BK)
    c = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (tile % blocks_m) * BM
        off_n = (tile // blocks_m) * (MAIN + EXTRA)
        for i in range(num_k):
            s = c % STAGES
            # use j of a stage waits for the consumers' release of use j - 1 (none for j = 0)
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1, pred=c >= STAGES)
            mbarrier.expect(ready.index(s), nbytes)
            _tma_load(x_desc, [off_m, i * BK], ready.index(s), x_bufs.index(s))
            _load_weights(w_desc, e_desc, g_bufs.index(s), u_bufs.index(s), eg_bufs.index(s),
                          eu_bufs.index(s), ready.index(s), off_n, N, i * BK, MAIN, EXTRA, GATED)
            c += 1


@gluon.jit
def _consumer(x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready, empty, Y, M, N, K, stride_ym,
              BM: gl.constexpr, BK: gl.constexpr, MAIN: gl.constexpr, EXTRA: gl.constexpr,
              GATED: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
              USE_PDL: gl.constexpr):
    """The MMA warpgroups: each tile's sums, one chunk's MMAs in flight, each stage freed once
    its MMAs retired (a tile's last one after its final wait); then the tile's epilogue."""
    main: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, MAIN, 16])
    ew: gl.constexpr = EXTRA if EXTRA > 0 else 8
    side: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                   instr_shape=[16, ew, 16])
    if USE_PDL:
        _gdc_wait()  # the rule of triton_pdl: no write before the wait
    blocks_m = gl.cdiv(M, BM)
    num_tiles = blocks_m * gl.cdiv(N, MAIN + EXTRA)
    num_k = gl.cdiv(K, BK)
    c = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (tile % blocks_m) * BM
        off_n = (tile // blocks_m) * (MAIN + EXTRA)
        acc_g = gl.zeros([BM, MAIN], gl.float32, main)
        acc_u = gl.zeros([BM, MAIN], gl.float32, main)
        acc_eg = gl.zeros([BM, ew], gl.float32, side)
        acc_eu = gl.zeros([BM, ew], gl.float32, side)
        for i in range(num_k):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            acc_g, acc_u, acc_eg, acc_eu = _mma_chunk(
                x_bufs.index(s), g_bufs.index(s), u_bufs.index(s), eg_bufs.index(s),
                eu_bufs.index(s), acc_g, acc_u, acc_eg, acc_eu, EXTRA, GATED, 1)
            # the previous chunk's MMAs have retired: free its stage (the tile's first chunk's
            # predecessor, the last tile's last chunk, was freed after that tile's final wait)
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=i > 0)
            c += 1
        acc_g, acc_u, acc_eg, acc_eu = _mma_wait(acc_g, acc_u, acc_eg, acc_eu, EXTRA, GATED, 0)
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1)
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, main))
        offs_n = off_n + gl.arange(0, MAIN, layout=gl.SliceLayout(0, main))
        _store(acc_g, acc_u, Y, Y, M, N, stride_ym, 0, offs_m, offs_n, GATED, 1)
        if EXTRA > 0:
            offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, side))
            offs_n = off_n + MAIN + gl.arange(0, EXTRA, layout=gl.SliceLayout(0, side))
            _store(acc_eg, acc_eu, Y, Y, M, N, stride_ym, 0, offs_m, offs_n, GATED, 1)


@gluon.jit(do_not_specialize=["M"])
def _persistent_kernel(x_desc, w_desc, e_desc, Y, M, N, K, stride_ym, BM: gl.constexpr,
                       MAIN: gl.constexpr, EXTRA: gl.constexpr, BK: gl.constexpr,
                       GATED: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                       USE_PDL: gl.constexpr):
    ew: gl.constexpr = EXTRA if EXTRA > 0 else 8
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    g_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, MAIN, BK], w_desc.layout)
    eg_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, ew, BK], e_desc.layout)
    if GATED:
        u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, MAIN, BK], w_desc.layout)
        eu_bufs = gl.allocate_shared_memory(e_desc.dtype, [STAGES, ew, BK], e_desc.layout)
    else:  # never read
        u_bufs = g_bufs
        eu_bufs = eg_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [(_consumer, (x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready, empty, Y, M, N, K,
                      stride_ym, BM, BK, MAIN, EXTRA, GATED, STAGES, WARPS, USE_PDL)),
         (_producer, (x_desc, w_desc, e_desc, x_bufs, g_bufs, u_bufs, eg_bufs, eu_bufs, ready,
                      empty, M, N, K, BM, BK, MAIN, EXTRA, GATED, STAGES, USE_PDL))],
        [1], [40])


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool,
                 cfg: Config, programs: int, use_pdl=False) -> tuple:
    """(grid, arguments, keywords) of a launch, or a ValueError for one the kernel cannot run."""
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    main, extra = tile_rows(cfg)
    bm = cfg.block_m
    if x.dtype != torch.bfloat16 or bm not in (64, 128) or cfg.num_warps * 16 > bm \
            or cfg.num_warps not in (4, 8) or cfg.split_k != 1:
        raise ValueError(f"the persistent Gluon GEMM takes bf16 x, tiles of 64 or 128 x rows, 4 "
                         f"or 8 consumer warps (16 rows a warp at least), no K split: {x.dtype}, "
                         f"block_m {bm}, {cfg.num_warps} warps, split {cfg.split_k}")
    ew = extra or 8
    descs = [TensorDescriptor.from_tensor(t, [rows, cfg.block_k], _layout(rows, cfg.block_k))
             for t, rows in ((x, bm), (weight, main), (weight, ew))]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, cfg.block_n)
    meta = dict(BM=bm, MAIN=main, EXTRA=extra, BK=cfg.block_k, GATED=gated,
                STAGES=cfg.num_stages, WARPS=cfg.num_warps, num_warps=cfg.num_warps,
                enable_fp_fusion=False, USE_PDL=use_pdl)
    return (max(1, min(tiles, programs)),), (*descs, out, M, N, K, out.stride(0)), meta


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool,
           cfg: Config, programs: int | None = None) -> torch.Tensor:
    """out = silu(gate) · up of the fused [gate | up] weight (`gated`), or x @ weight.T; bf16,
    16-byte aligned rows. `programs`: the persistent grid (default the SM count)."""
    if programs is None:
        programs = _sm_count(x.device.index if x.device.index is not None
                             else torch.cuda.current_device())
    grid, args, meta = _launch_args(x, weight, out, gated, cfg, programs)
    _persistent_kernel[grid](*args, **meta)
    return out


def compile_for_sm90(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool,
                     cfg: Config, programs: int = 132):
    """The kernel of a launch compiled, not run (tests.helpers.H200CompileTarget on a machine
    without a GPU); returns the compiled kernel."""
    grid, args, meta = _launch_args(x, weight, out, gated, cfg, programs)
    return _persistent_kernel.warmup(*args, grid=grid, **meta)
