"""One row's residual add + RMSNorm folded into its fused gate/up + SiLU GEMV (decode).

The post-attention twin of `triton_norm_qkv_rope`: every gate/up program (two gate and two up
rows at one row, the table's config) normalises the row itself after its PDL wait — o's output
and the residual are 3 KB each from L2, the norm weight is loaded before the wait with the
first weight chunks — instead of waiting for the norm kernel's completion and reading its
output. Sums and roundings: the norm's as in `triton_norm_qkv_rope` (the mean of squares in
another order than the norm kernel's), then `triton_gemv`'s FMA kernel's (its chunks summed in
the same order) and its SiLU epilogue.

ROLLOUT_FUSED_NORM_GATE_UP: "0" off (default), or "1" (the table's one-row gate/up config)."""
from __future__ import annotations

import os
from typing import Optional, Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rollout.layers import triton_gemv
from rollout.layers.split_sum import SplitSum
from rollout.layers.triton_gemv import Config, _silu_mul
from rollout.layers.triton_norm_qkv_rope import _added_chunk, _normed, row_chunks
from rollout.layers.triton_ops import _round
from rollout.triton_pdl import launch_options, pdl_wait

ENABLED = os.environ.get("ROLLOUT_FUSED_NORM_GATE_UP", "0")
if ENABLED not in ("0", "1"):
    raise ValueError(f"ROLLOUT_FUSED_NORM_GATE_UP={ENABLED!r}: 0 or 1")


@triton.jit
def _chunk_weights(w_ptr, wu_ptr, c: tl.constexpr, BLOCK_K: tl.constexpr):
    return (tl.load(w_ptr + c * BLOCK_K).to(tl.float32),
            tl.load(wu_ptr + c * BLOCK_K).to(tl.float32))


@triton.jit
def _norm_gate_up_kernel(
    X, Residual, NormW, ResidualOut, W, W_UP, Y, eps, inv_n, N, K, stride_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, PRELOAD: tl.constexpr,
    SPLIT: tl.constexpr, COMPILED: tl.constexpr, USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # tail rows clamped, never stored
    kk = tl.arange(0, BLOCK_K)[None, None, :]
    w_ptr = W + rows_n[None, :, None] * K + kk
    wu_ptr = W_UP + rows_n[None, :, None] * K + kk
    # the first PRELOAD chunks of the weights and the norm weight before the wait, the other
    # chunks right after it (before the row's loads: the weights are the long stream)
    w0, wu0 = _chunk_weights(w_ptr, wu_ptr, 0, BLOCK_K)
    nw0 = tl.load(NormW + kk).to(tl.float32)
    if CHUNKS >= 2:
        nw1 = tl.load(NormW + BLOCK_K + kk).to(tl.float32)
        if PRELOAD >= 2:
            w1, wu1 = _chunk_weights(w_ptr, wu_ptr, 1, BLOCK_K)
    if CHUNKS >= 3:
        nw2 = tl.load(NormW + 2 * BLOCK_K + kk).to(tl.float32)
        if PRELOAD >= 3:
            w2, wu2 = _chunk_weights(w_ptr, wu_ptr, 2, BLOCK_K)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    if CHUNKS >= 2 and PRELOAD < 2:
        w1, wu1 = _chunk_weights(w_ptr, wu_ptr, 1, BLOCK_K)
    if CHUNKS >= 3 and PRELOAD < 3:
        w2, wu2 = _chunk_weights(w_ptr, wu_ptr, 2, BLOCK_K)
    dt = Residual.dtype.element_ty
    first = (kk * 0 + tl.program_id(0)) == 0
    h0 = _added_chunk(X, Residual, kk, stride_split, SPLIT, dt, COMPILED)
    tl.store(ResidualOut + kk, h0, mask=first)
    squares = h0 * h0
    if CHUNKS >= 2:
        h1 = _added_chunk(X + BLOCK_K, Residual + BLOCK_K, kk, stride_split, SPLIT, dt, COMPILED)
        tl.store(ResidualOut + BLOCK_K + kk, h1, mask=first)
        squares += h1 * h1
    if CHUNKS >= 3:
        h2 = _added_chunk(X + 2 * BLOCK_K, Residual + 2 * BLOCK_K, kk, stride_split, SPLIT, dt,
                          COMPILED)
        tl.store(ResidualOut + 2 * BLOCK_K + kk, h2, mask=first)
        squares += h2 * h2
    var = tl.sum(squares) * inv_n
    if COMPILED:
        r = libdevice.rsqrt(var + eps)
    else:
        r = tl.math.rsqrt(var + eps)
    x = _normed(h0, r, nw0, dt, COMPILED)
    acc = x * w0
    acc_up = x * wu0
    if CHUNKS >= 2:
        x = _normed(h1, r, nw1, dt, COMPILED)
        acc += x * w1
        acc_up += x * wu1
    if CHUNKS >= 3:
        x = _normed(h2, r, nw2, dt, COMPILED)
        acc += x * w2
        acc_up += x * wu2
    gate = _round(tl.sum(acc, axis=2), dt, COMPILED)
    up = _round(tl.sum(acc_up, axis=2), dt, COMPILED)
    out = _silu_mul(gate, up, dt, COMPILED)
    tl.store(Y + offs_n[None, :], out, mask=(offs_n < N)[None, :])


def config_for(residual: torch.Tensor, weight: torch.Tensor) -> Optional[Config]:
    """The one-row gate/up launch config the fold takes (the table's FMA config, unsplit), or
    None where it does not apply."""
    cfg = triton_gemv._config(1, weight.shape[0], residual.shape[1], True)
    if cfg is None or cfg.dot or cfg.split_k != 1 or cfg.tma:
        return None
    return cfg


def applies(h: Union[torch.Tensor, SplitSum], residual: torch.Tensor, norm_weight: torch.Tensor,
            weight: torch.Tensor, enabled: bool) -> bool:
    if not enabled or not residual.is_cuda or residual.shape[0] != 1:
        return False
    if isinstance(h, SplitSum) and h.bias is not None:
        return False
    if not isinstance(h, SplitSum) and not h.is_contiguous():
        return False
    k = residual.shape[1]
    return (h.shape == residual.shape and h.dtype == residual.dtype == norm_weight.dtype
            == weight.dtype and residual.is_contiguous() and row_chunks(k) is not None
            and weight.dim() == 2 and weight.shape[1] == k and weight.shape[0] % 2 == 0
            and weight.is_contiguous() and config_for(residual, weight) is not None)


def norm_gate_up_silu(h: Union[torch.Tensor, SplitSum], residual: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, weight_gate_up: torch.Tensor,
                      inter: int, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) · up of rms_norm(h + residual), h + residual) for one row: weight [2·inter,
    K], gate rows first. The caller has checked `applies`."""
    block_k, chunks = row_chunks(residual.shape[1])
    if weight_gate_up.shape[0] != 2 * inter:
        raise ValueError(f"weight {tuple(weight_gate_up.shape)} is not [2·{inter}, K]")
    x, split, stride_split = ((h.partials, h.splits, h.partials.stride(0))
                              if isinstance(h, SplitSum) else (h, 1, 0))
    new_residual = torch.empty_like(residual)
    out = torch.empty(1, inter, dtype=residual.dtype, device=residual.device)
    preload = max(1, min(config.preload, chunks))
    _norm_gate_up_kernel[(triton.cdiv(inter, config.block_n),)](
        x, residual, norm_weight, new_residual, weight_gate_up, weight_gate_up[inter:], out, eps,
        1.0 / residual.shape[1], inter, residual.shape[1], stride_split,
        BLOCK_N=config.block_n, BLOCK_K=block_k, CHUNKS=chunks, PRELOAD=preload, SPLIT=split,
        COMPILED=triton_gemv._COMPILED, num_warps=config.num_warps, enable_fp_fusion=False,
        **launch_options(preloads_weights=True))
    return out, new_residual


__all__ = ["norm_gate_up_silu", "applies", "config_for", "ENABLED"]
