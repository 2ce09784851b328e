"""The one-row qkv projection with the rotary embedding and the KV-cache write in its epilogue.

Why: at batch 1 a decode layer is a chain of short kernels, and the rotary kernel between the
qkv GEMV and the attention is one more launch, wait and drain on that chain for a few hundred
bytes of work. The GEMV's programs can do it themselves if each one holds the two rows that a
rotation pairs: rows d and d + head_dim/2 of one head (HF's rotate-half layout). So a program of
this kernel streams the weight rows {d .. d+P-1} and {d+half .. d+half+P-1} of one head (the
FMA GEMV's K loop, `triton_gemv.fma_row_sums`, with the same pointer layout and row count as
the plain GEMV, so the same sums), adds the bias and rounds as the GEMV does, rotates q and k
heads as the rotary kernel does (every product rounded, no FMA contraction), and writes q, k
and v into the qkv output and the step's keys and values into the KV cache.

Bit for bit the plain GEMV followed by `triton_ops.apply_rotary_inplace(..., kv=...)` (the
specs check it). Used where the plain GEMV would run the FMA kernel unsplit (one row) and the
pool takes a fused KV store; ROLLOUT_FUSED_QKV_ROPE=0 turns it off."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from rollout.layers import triton_gemv
from rollout.layers.triton_ops import KVStore, _round
from rollout.triton_pdl import launch_options

FUSED_QKV_ROPE = os.environ.get("ROLLOUT_FUSED_QKV_ROPE", "1") != "0"


class QKVHeads(NamedTuple):
    """The head layout of a qkv output row: q heads, then k heads, then v heads."""
    q: int
    kv: int
    dim: int


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_kernel(
    X, W, Bias, Y, Cos, Sin, Loc, KBuf, VBuf, M, K, K_SPLIT, stride_xm, stride_ym, stride_ct,
    stride_st, stride_kb, stride_vb,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    COMPILED: tl.constexpr, PRELOAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    per_head = HALF // PAIRS
    head = tl.program_id(0) // per_head
    d0 = (tl.program_id(0) % per_head) * PAIRS
    # [2·PAIRS] rows: column j of the block is pair j // 2, low (d) or high (d + half) half j % 2
    offs_j = tl.arange(0, 2 * PAIRS)
    rows_n = (head * HEAD_DIM + d0 + offs_j // 2 + (offs_j % 2) * HALF).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    rows_m = tl.minimum(offs_m, M - 1)  # tail rows re-read a real row and are never stored
    offs_k = tl.arange(0, BLOCK_K)
    # The step's inputs (cos/sin tables, KV slots) are written before its first kernel, so
    # they load before the PDL wait, as the weights do.
    offs_d = d0 + tl.arange(0, PAIRS)
    cos = tl.load(Cos + rows_m[:, None] * stride_ct + offs_d[None, :]).to(tl.float32)
    sin = tl.load(Sin + rows_m[:, None] * stride_st + offs_d[None, :]).to(tl.float32)
    slot = tl.load(Loc + rows_m).to(tl.int64)
    x_ptr = X + rows_m[:, None, None] * stride_xm + offs_k[None, None, :]
    w_ptr = W + rows_n[None, :, None] * K + offs_k[None, None, :]
    acc, _ = triton_gemv.fma_row_sums(x_ptr, w_ptr, w_ptr, offs_k, K, K_SPLIT, BLOCK_K, EVEN_K,
                                      False, PRELOAD, False, USE_PDL)
    if HAS_BIAS:
        acc += tl.load(Bias + rows_n).to(tl.float32)[None, :]
    dt = Y.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(_round(acc, dt, COMPILED), [BLOCK_M, PAIRS, 2]))
    # as the rotary kernel: every product its own rounded tensor (HF's bf16 rotary)
    r1 = _round(_round(x1 * cos, dt, COMPILED) - _round(x2 * sin, dt, COMPILED), dt, COMPILED)
    r2 = _round(_round(x2 * cos, dt, COMPILED) + _round(x1 * sin, dt, COMPILED), dt, COMPILED)
    rotated = head < Q_HEADS + KV_HEADS  # v heads are not rotated
    o1 = tl.where(rotated, r1, x1)
    o2 = tl.where(rotated, r2, x2)
    m_ok = (offs_m < M)[:, None] & (offs_d < HALF)[None, :]  # [BLOCK_M, PAIRS]
    col = head * HEAD_DIM + offs_d[None, :]
    y = Y + offs_m[:, None] * stride_ym + col
    tl.store(y, o1, mask=m_ok)
    tl.store(y + HALF, o2, mask=m_ok)
    kv_head = head - Q_HEADS  # keys: 0 .. KV_HEADS - 1, values: KV_HEADS .. 2·KV_HEADS - 1
    kv_heads = tl.full([BLOCK_M, PAIRS], kv_head, tl.int32)  # tensor masks (the interpreter's)
    is_k = m_ok & (kv_heads >= 0) & (kv_heads < KV_HEADS)
    is_v = m_ok & (kv_heads >= KV_HEADS)
    in_head = offs_d[None, :]
    kb = KBuf + slot[:, None] * stride_kb + kv_head * HEAD_DIM + in_head
    vb = VBuf + slot[:, None] * stride_vb + (kv_head - KV_HEADS) * HEAD_DIM + in_head
    tl.store(kb, o1.to(KBuf.dtype.element_ty), mask=is_k)
    tl.store(kb + HALF, o2.to(KBuf.dtype.element_ty), mask=is_k)
    tl.store(vb, o1.to(VBuf.dtype.element_ty), mask=is_v)
    tl.store(vb + HALF, o2.to(VBuf.dtype.element_ty), mask=is_v)


def fused_config(x: torch.Tensor, weight: torch.Tensor,
                 heads: QKVHeads) -> Optional[triton_gemv.Config]:
    """The plain GEMV's launch config when this kernel can take its place (an unsplit FMA
    config whose rows per program pair up within a head's half), else None."""
    if not (FUSED_QKV_ROPE and x.shape[0] <= triton_gemv.FMA_MAX_M and heads.dim % 2 == 0
            and weight.shape[0] == (heads.q + 2 * heads.kv) * heads.dim):
        return None
    cfg = triton_gemv._config(x.shape[0], weight.shape[0], x.shape[1])
    pairs = cfg.block_n // 2
    if cfg.dot or cfg.tma or cfg.split_k != 1 or cfg.block_n % 2 or (heads.dim // 2) % pairs:
        return None
    return cfg


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             cos: torch.Tensor, sin: torch.Tensor, heads: QKVHeads, kv: KVStore,
             config: triton_gemv.Config, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) → [M, (q + 2·kv) · dim] with its q and k heads rotated (cos/sin
    [M, 1, dim/2] of x's dtype, as `apply_rotary_inplace`) and the rotated keys and the values
    written at the rows' KV slots (`kv`: its `v` is the output's value view, unused here).
    `config`: from `fused_config`; `out`: where to write the output (a new tensor if None)."""
    M, K = x.shape
    half = heads.dim // 2
    for c in (cos, sin):
        if c.shape != (M, 1, half) or c.dtype != x.dtype or c.stride(2) != 1:
            raise ValueError(f"cos/sin {tuple(c.shape)} {c.dtype} do not fit {M} rows of "
                             f"{heads.dim}-dim heads in {x.dtype}")
    kb, vb = kv.k_buffer, kv.v_buffer
    if (kb.shape[1:] != (heads.kv, heads.dim) or vb.shape[1:] != (heads.kv, heads.dim)
            or not kb.is_contiguous() or not vb.is_contiguous() or kv.loc.shape != (M,)):
        raise ValueError(f"KV store does not fit {M} rows of {heads}: buffers "
                         f"{tuple(kb.shape)} / {tuple(vb.shape)}, loc {tuple(kv.loc.shape)}")
    triton_gemv._check(x, weight)
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(M, weight.shape[0], dtype=x.dtype, device=x.device)
    elif out.shape != (M, weight.shape[0]) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous "
                         f"[{M}, {weight.shape[0]}] {x.dtype} tensor")
    pairs = config.block_n // 2
    _, k_split = triton_gemv.split_k_range(K, config)  # whole chunks, as the plain GEMV's loop
    preload = max(1, min(config.preload, k_split // config.block_k))
    _qkv_rope_kernel[((heads.q + 2 * heads.kv) * half // pairs,)](
        x, weight, bias if bias is not None else out, out, cos, sin, kv.loc, kb, vb, M, K, k_split,
        x.stride(0), out.stride(0), cos.stride(0), sin.stride(0), kb.stride(0), vb.stride(0),
        Q_HEADS=heads.q, KV_HEADS=heads.kv, HEAD_DIM=heads.dim, PAIRS=pairs,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_K=config.block_k, EVEN_K=K % config.block_k == 0,
        HAS_BIAS=bias is not None, COMPILED=triton_gemv._COMPILED, PRELOAD=preload,
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False,
        **launch_options(preloads_weights=True))
    return out


__all__ = ["qkv_rope", "fused_config", "QKVHeads", "FUSED_QKV_ROPE"]
