"""The fused gate/up + SiLU at a decode batch (up to `block_m` rows) with its weight rows split
evenly over a fixed number of programs: each program takes a contiguous run of 16-row units of
the gate rows (and the same up rows), all of the batch's rows, and one K loop.

Why: at 128 rows the TMA kernel's 64-row tiles make 140 tiles of gate/up (280 programs with two
M blocks) for the H200's 132 SMs, so some SMs run one program more than the others and set the
kernel's time (ncu, twelfth session: SMs active 77% of its cycles). Stream-K evened the work by
cutting tiles along K and lost more to the restarted pipelines and partial sums than it saved.
Here the unit of work is 16 weight rows (wgmma's narrow side): 8,960 gate rows are 560 units,
so 132 programs take 4 or 5 units each (a 64-row tile and, for 32 of them, one 16-row tile),
every program streams its own rows once in one pipelined K loop, and x's K chunk is shared by
the tiles. A program without a fifth unit points that tile past the weight's last row, where TMA
fills zeros without reading memory.

Rounding: gate and up rounded to the dtype, then silu_and_mul's `silu(gate).to(dtype) * up`
(triton_gemv._epilogue), K summed in chunk order as the TMA kernel with the same block_k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rollout.layers.triton_gemv import Config, _epilogue
from rollout.layers.triton_ops import _is_compiled
from rollout.triton_pdl import launch_options, pdl_wait


@triton.jit(do_not_specialize=["M"])
def _gate_up_even_kernel(x_desc, w_desc, wx_desc, Y, M, I, K, stride_ym, UNITS, PROGRAMS,
                         BLOCK_M: tl.constexpr, BLOCK_U: tl.constexpr, MAIN: tl.constexpr,
                         BLOCK_K: tl.constexpr, COMPILED: tl.constexpr, PREC: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    u0 = pid * UNITS // PROGRAMS
    extra = (pid + 1) * UNITS // PROGRAMS - u0 > MAIN  # this program has one unit more
    row0 = u0 * BLOCK_U
    rows_x = row0 + MAIN * BLOCK_U  # the extra unit's first gate row
    gate_x = tl.where(extra, rows_x, 2 * I)  # past the weight: zeros, no memory read
    up_x = tl.where(extra, I + rows_x, 2 * I)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    acc = tl.zeros([BLOCK_M, MAIN * BLOCK_U], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, MAIN * BLOCK_U], dtype=tl.float32)
    acc_x = tl.zeros([BLOCK_M, BLOCK_U], dtype=tl.float32)
    acc_up_x = tl.zeros([BLOCK_M, BLOCK_U], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([0, k])
        acc = tl.dot(x, w_desc.load([row0, k]).T, acc, input_precision=PREC)
        acc_up = tl.dot(x, w_desc.load([I + row0, k]).T, acc_up, input_precision=PREC)
        acc_x = tl.dot(x, wx_desc.load([gate_x, k]).T, acc_x, input_precision=PREC)
        acc_up_x = tl.dot(x, wx_desc.load([up_x, k]).T, acc_up_x, input_precision=PREC)
    offs_m = tl.arange(0, BLOCK_M)
    _epilogue(acc, acc_up, Y, Y, Y, offs_m, row0 + tl.arange(0, MAIN * BLOCK_U), M, I,
              stride_ym, 0, False, True, 1, COMPILED)
    offs_x = tl.where(extra, rows_x, I) + tl.arange(0, BLOCK_U)  # >= I: masked off
    _epilogue(acc_x, acc_up_x, Y, Y, Y, offs_m, offs_x, M, I, stride_ym, 0, False, True, 1,
              COMPILED)


_COMPILED = _is_compiled(_gate_up_even_kernel)


def main_units(inter: int, cfg: Config) -> int:
    """Units in every program's main tile (a power of two); ValueError when the config cannot
    split `inter` gate rows this way."""
    units, programs = inter // cfg.block_n, cfg.even_programs
    main = units // programs
    if inter % cfg.block_n or main < 1 or main & (main - 1) or units - main * programs > programs:
        raise ValueError(f"even split: {inter} rows in units of {cfg.block_n} over {programs} "
                         "programs needs a power-of-two number of whole units a program")
    return main


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool,
           cfg: Config) -> torch.Tensor:
    """out = silu(gate) · up of the fused [gate | up] weight for x [M <= block_m, K]; shapes
    checked by triton_gemv. TMA wants 16-byte aligned rows."""
    M, K = x.shape
    inter = weight.shape[0] // 2
    size = x.element_size()
    if not gated:
        raise ValueError("the even split serves the fused gate/up + SiLU only")
    if M > cfg.block_m:
        raise ValueError(f"{M} rows: the even split takes all rows in one block of {cfg.block_m}")
    if (x.stride(0) * size) % 16 or (K * size) % 16 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError(f"TMA needs 16-byte aligned rows: x stride {x.stride(0)}, K {K}")
    main = main_units(inter, cfg)
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [main * cfg.block_n, cfg.block_k])
    wx_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    _gate_up_even_kernel[(cfg.even_programs,)](
        x_desc, w_desc, wx_desc, out, M, inter, K, out.stride(0), inter // cfg.block_n,
        cfg.even_programs, BLOCK_M=cfg.block_m, BLOCK_U=cfg.block_n, MAIN=main,
        BLOCK_K=cfg.block_k, COMPILED=_COMPILED,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **launch_options())
    return out
