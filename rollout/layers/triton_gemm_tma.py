"""The decode-batch GEMM fed by the Tensor Memory Accelerator (Hopper's TMA): x [M, K] @ W^T, or
the fused gate/up + SiLU, tiled along M and N, for triton_gemv's table entries with `tma=True`.

Why: at decode batches (tens to hundreds of rows) the qkv and o projections are latency-bound
and cuBLAS takes 5-6 µs for a few MB of weights. Loading the tiles with TMA (one instruction a
tile, no address math in the threads, zero-filled past the tensor's edge) lets one program keep
six K chunks in flight: alone on an H200, qkv 6.0 -> 5.0 µs and o 5.5 -> 4.8 at 128 rows, the
fused gate/up + SiLU 23.6 -> 19.1 at 64 (`benchmarks/gpu_gemm_tma.py`). The epilogue is
triton_gemv's (bias, or SiLU · up, rounded as the unfused path). Off a Hopper-class GPU the
interpreter runs it too (CPU specs).

Under PDL a program may prefetch the first `Config.prefetch_k` columns of its weight rows into
L2 before it waits for the kernel before it (Hopper's bulk prefetch; a hint, the same bits): the
weights are no earlier kernel's output, so they stream while that kernel finishes, as the
one-row kernels' preloads do (the table's 128-row entries; at 32-64 rows it measured slower).

Two options of the launch config: `split_k` (down's K = 8,960 over 5-7 programs a tile, and
o's and qkv's 1,536 over 2-4 at decode batches; fp32 partials summed in split order,
deterministic: by triton_gemv's reduce kernel, or in the engine by the kernel that reads the
output (SplitSum); down at 32-64 rows 10.5 µs vs cuBLAS 11.5, at 128 rows, swapped, down +
add-norm 12.85 µs vs cuBLAS + add-norm 13.53) and `swap_ab` (out^T = W x^T: the weight tile
fills wgmma's 64-row side and x's rows the narrow one; gate/up at 128 rows 22.0 µs vs 22.8).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rollout.layers.split_sum import SplitSum
from rollout.layers.triton_gemv import (Config, _epilogue, finish_split, split_k_range,
                                         split_partials)
from rollout.layers.triton_ops import _is_compiled, bulk_prefetch_l2
from rollout.triton_pdl import launch_options, pdl_wait


@triton.jit
def _prefetch_l2(W, row0, rows_end, k0, k_end, K, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Hopper's bulk L2 prefetch of W[row0 : row0 + ROWS, k0 : k0 + COLS] (rows < rows_end,
    columns < min(k_end, K)), one instruction a row: a hint, it changes no value."""
    eb: tl.constexpr = W.dtype.element_ty.primitive_bitwidth // 8
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.minimum(COLS, tl.minimum(k_end, K) - k0)
    size = (cols * eb) // 16 * 16  # the instruction's unit
    valid = (rows < rows_end) & (size > 0)
    addr = W.to(tl.int64) + (rows.to(tl.int64) * K + k0) * eb
    bulk_prefetch_l2(addr, size + 0 * rows, valid)  # the size as a tensor of the rows' shape


@triton.jit
def _tile_dot(x, w, acc, SWAP_AB: tl.constexpr, PREC: tl.constexpr):
    """acc + x · w^T, or its transpose (w · x^T) accumulated when SWAP_AB."""
    if SWAP_AB:
        acc = tl.dot(w, x.T, acc, input_precision=PREC)
    else:
        acc = tl.dot(x, w.T, acc, input_precision=PREC)
    return acc


@triton.jit
def tma_sums(x_desc, w_desc, off_m, off_n, off_n2, k_start, K_SPLIT, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
             PAIRED: tl.constexpr, PREC: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] fp32 sums x[off_m:] · W[off_n:]^T over this program's K range
    (and x · W[off_n2:]^T when PAIRED — the up half of gate/up — else zeros), the tiles loaded
    by TMA. Past M, N or K: zeros; a split's range ends at the next split's start (K_SPLIT is a
    multiple of BLOCK_K). SWAP_AB: the weight tile is the MMA's M side (out^T = W x^T), so a few
    rows of x fill the narrow N side instead of padding the 64-row M side of Hopper's wgmma."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_start + K_SPLIT, BLOCK_K):
        x = x_desc.load([off_m, k])
        acc = _tile_dot(x, w_desc.load([off_n, k]), acc, SWAP_AB, PREC)
        if PAIRED:
            acc_up = _tile_dot(x, w_desc.load([off_n2, k]), acc_up, SWAP_AB, PREC)
    if SWAP_AB:
        acc, acc_up = acc.T, acc_up.T
    return acc, acc_up


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(x_desc, w_desc, W, Bias, Y, P, M, N, K, K_SPLIT, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT: tl.constexpr, SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GATED: tl.constexpr, COMPILED: tl.constexpr, PREC: tl.constexpr,
                     PREFETCH_K: tl.constexpr, USE_PDL: tl.constexpr):
    # M blocks innermost: the programs that read one weight block run side by side (L2 hits)
    blocks_m = tl.cdiv(M, BLOCK_M)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    off_m = (pid % blocks_m) * BLOCK_M
    off_n = (pid // blocks_m) * BLOCK_N
    k_start = pid_k * K_SPLIT
    # The weights are no earlier kernel's output: under PDL the first PREFETCH_K columns of this
    # program's weight rows stream into L2 while the kernel before still runs (the first M
    # block's program asks; the others read the same rows)
    if COMPILED and PREFETCH_K > 0 and off_m == 0:
        _prefetch_l2(W, off_n, N, k_start, k_start + K_SPLIT, K, BLOCK_N, PREFETCH_K)
        if GATED:  # the up half's rows start at N
            _prefetch_l2(W, N + off_n, 2 * N, k_start, k_start + K_SPLIT, K, BLOCK_N,
                         PREFETCH_K)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    acc, acc_up = tma_sums(x_desc, w_desc, off_m, off_n, N + off_n, k_start, K_SPLIT, BLOCK_M,
                           BLOCK_N, BLOCK_K, SWAP_AB, GATED, PREC)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _epilogue(acc, acc_up, Bias, Y, P, offs_m, offs_n, M, N, stride_ym, pid_k, HAS_BIAS, GATED,
              SPLIT, COMPILED)


_COMPILED = _is_compiled(_gemm_tma_kernel)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
           gated: bool, cfg: Config, defer_split: bool = False) -> Union[torch.Tensor, SplitSum]:
    """out = x @ weight.T (+ bias), or silu(gate) · up of the fused [gate | up] weight; shapes
    checked by triton_gemv. TMA wants 16-byte aligned rows. Split along K: fp32 partials summed
    in split order by triton_gemv's reduce kernel (deterministic), or with `defer_split` handed
    back to be summed by their reader (triton_gemv.finish_split)."""
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    size = x.element_size()
    if (x.stride(0) * size) % 16 or (K * size) % 16 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError(f"TMA needs 16-byte aligned rows: x stride {x.stride(0)}, K {K}")
    split, k_split = split_k_range(K, cfg)
    partials = split_partials(M, N, gated, split, out)
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
    _gemm_tma_kernel[grid](
        x_desc, w_desc, weight, bias if bias is not None else out, out, partials, M, N, K, k_split,
        out.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=split, SWAP_AB=bool(cfg.swap_ab), HAS_BIAS=bias is not None, GATED=gated,
        COMPILED=_COMPILED, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        PREFETCH_K=cfg.prefetch_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **launch_options())
    return finish_split(partials, bias, out, gated, split, defer_split)
