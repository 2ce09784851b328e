"""The MLP's down projection with the SiLU · up in its prologue: out = (silu(gate) · up) @ W^T
read from the plain [gate | up] GEMM output, tiles loaded by TMA (Hopper), for the row counts
where `gemv_launch.down_silu_config` has an entry.

Why: at decode batches of ~128 rows and in prefill chunks the gated MLP is two GEMMs and an
activation. Fusing the SiLU into gate/up's epilogue (triton_gemm_tma's gated kernel) ties the
large gate/up GEMM to a Triton mainloop, which at 128 rows runs ~4 µs slower than cuBLAS's
(22.2 vs 18.1 µs on an H200); leaving it as its own kernel costs a full read and write of the
[M, 2·I] intermediate (a prefill chunk of 8,192 rows: ~107 µs a layer). Here gate/up stays on
cuBLAS and the down GEMM, already a Triton TMA kernel at those rows, applies the activation to
each x tile as it loads it: the intermediate is read once, by the kernel that needed it anyway.

Rounding: the activation is silu_and_mul's, bit for bit (gate and up are the GEMM's rounded
outputs; `silu(gate).to(dtype) * up` rounded, libdevice expf, IEEE division), so the result is
what the TMA GEMM gives for silu_and_mul's output with the same launch config. Split along K,
the fp32 partials go to the caller as a SplitSum (the next add + RMSNorm sums them) or are
summed by triton_gemv's reduce kernel.
"""
from __future__ import annotations

from typing import Union

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rollout.layers.split_sum import SplitSum
from rollout.layers.triton_gemm_tma import _prefetch_l2, _tile_dot
from rollout.layers.triton_gemv import (Config, _epilogue, _silu_mul, finish_split,
                                         split_k_range, split_partials)
from rollout.layers.triton_ops import _is_compiled
from rollout.triton_pdl import launch_options, pdl_wait


@triton.jit(do_not_specialize=["M"])
def _down_silu_kernel(gate_desc, up_desc, w_desc, W, Y, P, M, N, K, K_SPLIT, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT: tl.constexpr, SWAP_AB: tl.constexpr, COMPILED: tl.constexpr,
                      PREC: tl.constexpr, PREFETCH_K: tl.constexpr, USE_PDL: tl.constexpr):
    blocks_m = tl.cdiv(M, BLOCK_M)  # M blocks innermost: one weight block's programs together
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    off_m = (pid % blocks_m) * BLOCK_M
    off_n = (pid // blocks_m) * BLOCK_N
    k_start = pid_k * K_SPLIT
    if COMPILED and PREFETCH_K > 0 and off_m == 0:  # weights: no earlier kernel's output
        _prefetch_l2(W, off_n, N, k_start, k_start + K_SPLIT, K, BLOCK_N, PREFETCH_K)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    dt = Y.dtype.element_ty
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_start + K_SPLIT, BLOCK_K):
        # past M or K both tiles are zero-filled, and silu(0) · 0 = 0 adds nothing
        gate = gate_desc.load([off_m, k]).to(tl.float32)
        up = up_desc.load([off_m, k]).to(tl.float32)
        act = _silu_mul(gate, up, dt, COMPILED).to(dt)
        acc = _tile_dot(act, w_desc.load([off_n, k]), acc, SWAP_AB, PREC)
    if SWAP_AB:
        acc = acc.T
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _epilogue(acc, acc, Y, Y, P, offs_m, offs_n, M, N, stride_ym, pid_k, False, False, SPLIT,
              COMPILED)


_COMPILED = _is_compiled(_down_silu_kernel)


def check_shapes(gate_up: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError unless gate_up is [M, 2·I] and weight [N, I], rows TMA can read (16-byte
    aligned, the up half's start too), one 16-bit or fp32 dtype."""
    if gate_up.dim() != 2 or weight.dim() != 2 or gate_up.shape[1] != 2 * weight.shape[1]:
        raise ValueError(f"down_silu: gate_up {tuple(gate_up.shape)} is not [M, 2·I] for a "
                         f"weight {tuple(weight.shape)} of [N, I]")
    if gate_up.dtype != weight.dtype:
        raise ValueError(f"down_silu: gate_up {gate_up.dtype} vs weight {weight.dtype}")
    size = gate_up.element_size()
    inter = weight.shape[1]
    if (gate_up.stride(1) != 1 or not weight.is_contiguous() or (gate_up.stride(0) * size) % 16
            or (inter * size) % 16 or gate_up.data_ptr() % 16 or weight.data_ptr() % 16):
        raise ValueError(f"down_silu: TMA needs 16-byte aligned rows (gate_up strides "
                         f"{gate_up.stride()}, I = {inter})")


def down_silu(gate_up: torch.Tensor, weight: torch.Tensor, cfg: Config,
              defer_split: bool = False) -> Union[torch.Tensor, SplitSum]:
    """(silu(gate) · up) @ weight.T for gate_up [M, 2·I] laid out [gate | up] and the down weight
    [N, I]: [M, N] in gate_up's dtype, or with `defer_split` and a split config its fp32 partials
    as a SplitSum for the next kernel to sum."""
    check_shapes(gate_up, weight)
    M = gate_up.shape[0]
    N, K = weight.shape
    out = torch.empty(M, N, dtype=gate_up.dtype, device=gate_up.device)
    split, k_split = split_k_range(K, cfg)
    partials = split_partials(M, N, False, split, out)
    block = [cfg.block_m, cfg.block_k]
    gate_desc = TensorDescriptor.from_tensor(gate_up[:, :K], block)
    up_desc = TensorDescriptor.from_tensor(gate_up[:, K:], block)
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
    _down_silu_kernel[grid](
        gate_desc, up_desc, w_desc, weight, out, partials, M, N, K, k_split, out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split,
        SWAP_AB=bool(cfg.swap_ab), COMPILED=_COMPILED,
        PREC="ieee" if gate_up.dtype == torch.float32 else "tf32", PREFETCH_K=cfg.prefetch_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **launch_options())
    return finish_split(partials, None, out, False, split, defer_split)
