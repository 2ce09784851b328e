"""The fused gate/up + SiLU on a fixed grid of programs that each take an equal share of the
weight rows: one main tile of `block_n` gate (and up) rows, and one extra tile of `extra_n`
rows from the rows the main tiles leave.

Why: at decode batches of 65-128 rows this GEMM (55 MB of weights for Qwen2-1.5B) is the
largest kernel of a step, and its power-of-two tiles do not divide evenly over an H200's 132
SMs: 8,960 gate rows are 140 tiles of 64 (8 SMs run a second one) or 280 of 32 (16 SMs run a
third). With rows this many programs share at the batch's 128 rows, an SM's tensor cores, not
the memory, pace the SMs that run the extra tile; the others idle at the end (ncu: 23% of the
SM cycles). Here `programs` (the SM count) programs each take the gate rows
[p·block_n, (p + 1)·block_n) and [programs·block_n + p·extra_n, ... + extra_n) (and the same
up rows): 8,960 = 132 · 64 + 32 · 16, so 32 programs take 80 rows and 100 take 64 — the
slowest SM has 1.18× the mean share instead of 1.41× (16 SMs with 3 × 32 rows).

Every program runs the same instructions: a tile past the last row is loaded by TMA as zeros
(no memory read) and its outputs are masked. Tiles and rounding as triton_gemm_tma's
(non-swapped: x's rows on wgmma's M side; gate and up each rounded to the dtype, then
silu(gate) · up as the unfused path): the same bits as the one-tile-a-program kernel for the
same `block_k`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rollout.layers.triton_gemm_tma import _prefetch_l2
from rollout.layers.triton_gemv import Config, _epilogue
from rollout.layers.triton_ops import _is_compiled
from rollout.triton_pdl import launch_options, pdl_wait


@triton.jit
def _prefetch_rows(W, row0, N, K, ROWS: tl.constexpr, PREFETCH_K: tl.constexpr):
    """L2 prefetch of PREFETCH_K columns of gate rows row0.. (< N) and of their up rows."""
    _prefetch_l2(W, row0, N, 0, K, K, ROWS, PREFETCH_K)
    _prefetch_l2(W, N + row0, 2 * N, 0, K, K, ROWS, PREFETCH_K)


@triton.jit(do_not_specialize=["M"])
def _gate_up_balanced_kernel(
    x_desc, gate_desc, up_desc, gate_extra_desc, up_extra_desc, W, Y, M, N, K, stride_ym,
    PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXTRA_N: tl.constexpr,
    BLOCK_K: tl.constexpr, COMPILED: tl.constexpr, PREC: tl.constexpr, PREFETCH_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    blocks_m = tl.cdiv(M, BLOCK_M)  # M blocks innermost: one weight share's programs side by side
    off_m = (tl.program_id(0) % blocks_m) * BLOCK_M
    share = tl.program_id(0) // blocks_m
    off_n = share * BLOCK_N
    off_x = PROGRAMS * BLOCK_N + share * EXTRA_N
    if COMPILED and PREFETCH_K > 0 and off_m == 0:  # weights: no earlier kernel's output
        _prefetch_rows(W, off_n, N, K, BLOCK_N, PREFETCH_K)
        _prefetch_rows(W, off_x, N, K, EXTRA_N, PREFETCH_K)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_gate_x = tl.zeros([BLOCK_M, EXTRA_N], dtype=tl.float32)
    acc_up_x = tl.zeros([BLOCK_M, EXTRA_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([off_m, k])
        acc_gate = tl.dot(x, gate_desc.load([off_n, k]).T, acc_gate, input_precision=PREC)
        acc_up = tl.dot(x, up_desc.load([off_n, k]).T, acc_up, input_precision=PREC)
        acc_gate_x = tl.dot(x, gate_extra_desc.load([off_x, k]).T, acc_gate_x,
                            input_precision=PREC)
        acc_up_x = tl.dot(x, up_extra_desc.load([off_x, k]).T, acc_up_x, input_precision=PREC)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    # the epilogue's bias and partials pointers are unused (no bias, one split): Y stands in
    _epilogue(acc_gate, acc_up, Y, Y, Y, offs_m, off_n + tl.arange(0, BLOCK_N), M, N, stride_ym,
              0, False, True, 1, COMPILED)
    _epilogue(acc_gate_x, acc_up_x, Y, Y, Y, offs_m, off_x + tl.arange(0, EXTRA_N), M, N,
              stride_ym, 0, False, True, 1, COMPILED)


_COMPILED = _is_compiled(_gate_up_balanced_kernel)


def covers(inter: int, cfg: Config) -> bool:
    """The config's programs reach every one of `inter` gate rows."""
    return cfg.programs * (cfg.block_n + cfg.extra_n) >= inter


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: Config) -> torch.Tensor:
    """out = silu(x @ gate^T) · (x @ up^T) for the fused [gate | up] weight (shapes and TMA
    alignment checked by the caller, triton_gemm_tma.launch)."""
    M, K = x.shape
    N = weight.shape[0] // 2
    if cfg.split_k != 1 or cfg.swap_ab or cfg.extra_n < 16 or cfg.programs < 1:
        raise ValueError(f"{cfg}: the balanced gate/up takes one split, no swap, extra_n >= 16 "
                         "(a tl.dot side) and programs >= 1")
    if not covers(N, cfg):
        raise ValueError(f"{cfg.programs} programs of {cfg.block_n} + {cfg.extra_n} rows do not "
                         f"cover {N} gate rows")
    gate, up = weight[:N], weight[N:]  # views: a tile past a half's last row loads zeros
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    descs = [TensorDescriptor.from_tensor(half, [rows, cfg.block_k])
             for rows in (cfg.block_n, cfg.extra_n) for half in (gate, up)]
    _gate_up_balanced_kernel[(triton.cdiv(M, cfg.block_m) * cfg.programs,)](
        x_desc, *descs, weight, out, M, N, K, out.stride(0),
        PROGRAMS=cfg.programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, EXTRA_N=cfg.extra_n,
        BLOCK_K=cfg.block_k, COMPILED=_COMPILED,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", PREFETCH_K=cfg.prefetch_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **launch_options())
    return out


__all__ = ["launch", "covers"]
