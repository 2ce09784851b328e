"""The qkv projection with the rotary embedding and the KV-cache write in its epilogue (decode).

Why: a decode layer is a chain of kernels, and the rotary kernel between the qkv GEMM and the
attention is one more launch, wait and drain on that chain (and at decode batches one more read
and write of the qkv output). The GEMM's programs can do its work themselves if each one holds
the two rows that a rotation pairs: rows d and d + head_dim/2 of one head (HF's rotate-half
layout). So a program here computes the output columns {d .. d+P-1} and {d+half .. d+half+P-1}
of one head, adds the bias and rounds as the plain GEMM does, rotates q and k heads as the
rotary kernel does (every product rounded, no FMA contraction), and writes q, k and v into the
qkv output and the step's keys and values into the KV cache. Two kernels, one per kind of the
plain GEMM's launch config:
  * one row, and the small batches (2-4 rows) the table gives the FMA GEMV: its K loop
    (`triton_gemv.fma_row_sums`), its pointer block being the 2·P rows above, as many as the
    plain GEMV's program has, laid out alike (the same sums);
  * decode batches: the TMA-fed tensor-core tiles (`triton_gemm_tma.tma_sums` with two weight
    tiles of P rows, as its fused gate/up takes gate and up), where the table's config is
    unsplit (64-128 rows: in the engine, fifteenth session, decode graph batch 64 1.5743 ->
    1.5514 ms, batch 128 1.8482 -> 1.8484; forced unsplit at 32 rows it lost, 1.5501 -> 1.5621,
    benchmarks/ab_fifteenth_session_d.json). On the H200 the table now names the Gluon GEMM at
    17-128 rows (forty-fifth and forty-eighth sessions), split along K with its sums in the
    rotary kernel, so this form runs where those entries fall back to TMA.

Bit for bit the plain GEMM followed by `triton_ops.apply_rotary_inplace(..., kv=...)` (the
specs check it). Used where `fused_config` says (and the pool takes a fused KV store);
ROLLOUT_FUSED_QKV_ROPE=0 turns it off, =one_row keeps the FMA form only (one row, small
batches)."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rollout.layers import triton_gemm_tma, triton_gemv
from rollout.layers.triton_ops import KVStore, _round
from rollout.triton_pdl import launch_options, pdl_wait

# "1": both kernels; "one_row": the FMA form only (one row and small batches; decode batches:
# the GEMM + the rotary kernel); "0": neither
FUSED_QKV_ROPE = os.environ.get("ROLLOUT_FUSED_QKV_ROPE", "1")
if FUSED_QKV_ROPE not in ("1", "one_row", "0"):
    raise ValueError(f"ROLLOUT_FUSED_QKV_ROPE={FUSED_QKV_ROPE!r}: 1, one_row or 0")


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
    offs_d = d0 + tl.arange(0, PAIRS)
    cos, sin, slot = _step_inputs(Cos, Sin, Loc, rows_m, offs_d, stride_ct, stride_st)
    if HAS_BIAS:  # a weight: loaded before the wait, not a memory latency after the K loop
        bias = tl.load(Bias + rows_n).to(tl.float32)
    x_ptr = X + rows_m[:, None, None] * stride_xm + offs_k[None, None, :]
    w_ptr = W + rows_n[None, :, None] * K + offs_k[None, None, :]
    acc, _ = triton_gemv.fma_row_sums(x_ptr, w_ptr, w_ptr, offs_k, K, K_SPLIT, BLOCK_K, EVEN_K,
                                      False, PRELOAD, False, USE_PDL)
    if HAS_BIAS:
        acc += bias[None, :]
    x1, x2 = tl.split(tl.reshape(_round(acc, Y.dtype.element_ty, COMPILED), [BLOCK_M, PAIRS, 2]))
    _rotate_and_store(x1, x2, cos, sin, slot, offs_m, M, head, offs_d, Y, KBuf, VBuf, stride_ym,
                      stride_kb, stride_vb, Q_HEADS, KV_HEADS, HEAD_DIM, COMPILED)


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_tma_kernel(
    x_desc, w_desc, W, Bias, Y, Cos, Sin, Loc, KBuf, VBuf, M, K, K_SPLIT, stride_ym, stride_ct,
    stride_st, stride_kb, stride_vb,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, COMPILED: tl.constexpr,
    PREC: tl.constexpr, PREFETCH_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Decode batches: triton_gemm_tma's tiles, a program's weight tile being the BLOCK_N rows
    d.. of one head and the BLOCK_N rows d + half.. (M blocks innermost, as there)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    blocks_m = tl.cdiv(M, BLOCK_M)
    off_m = (tl.program_id(0) % blocks_m) * BLOCK_M
    tile = tl.program_id(0) // blocks_m
    per_head = HALF // BLOCK_N
    head = tile // per_head
    d0 = (tile % per_head) * BLOCK_N
    off_n = head * HEAD_DIM + d0
    offs_m = off_m + tl.arange(0, BLOCK_M)
    rows_m = tl.minimum(offs_m, M - 1)
    offs_d = d0 + tl.arange(0, BLOCK_N)
    cos, sin, slot = _step_inputs(Cos, Sin, Loc, rows_m, offs_d, stride_ct, stride_st)
    if COMPILED and PREFETCH_K > 0 and off_m == 0:  # as triton_gemm_tma's L2 prefetch
        n = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
        triton_gemm_tma._prefetch_l2(W, off_n, n, 0, K, K, BLOCK_N, PREFETCH_K)
        triton_gemm_tma._prefetch_l2(W, off_n + HALF, n, 0, K, K, BLOCK_N, PREFETCH_K)
    if HAS_BIAS:  # weights: loaded before the wait, not a memory latency after the K loop
        bias1 = tl.load(Bias + off_n + tl.arange(0, BLOCK_N)).to(tl.float32)
        bias2 = tl.load(Bias + off_n + HALF + tl.arange(0, BLOCK_N)).to(tl.float32)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    acc1, acc2 = triton_gemm_tma.tma_sums(x_desc, w_desc, off_m, off_n, off_n + HALF, 0, K_SPLIT,
                                          BLOCK_M, BLOCK_N, BLOCK_K, False, True, PREC)
    if HAS_BIAS:
        acc1 += bias1[None, :]
        acc2 += bias2[None, :]
    dt = Y.dtype.element_ty
    _rotate_and_store(_round(acc1, dt, COMPILED), _round(acc2, dt, COMPILED), cos, sin, slot,
                      offs_m, M, head, offs_d, Y, KBuf, VBuf, stride_ym, stride_kb, stride_vb,
                      Q_HEADS, KV_HEADS, HEAD_DIM, COMPILED)


@triton.jit
def _step_inputs(Cos, Sin, Loc, rows_m, offs_d, stride_ct, stride_st):
    """The rows' cos and sin at the columns d = offs_d, and their KV slots. The step's inputs
    — the slots written before its first kernel, cos and sin by that kernel (`triton_embed`),
    complete before the first layer's norm lets its successor launch (`DecoderLayer.forward`)
    — load before the PDL wait, as the weights do."""
    cos = tl.load(Cos + rows_m[:, None] * stride_ct + offs_d[None, :]).to(tl.float32)
    sin = tl.load(Sin + rows_m[:, None] * stride_st + offs_d[None, :]).to(tl.float32)
    return cos, sin, tl.load(Loc + rows_m).to(tl.int64)


@triton.jit
def _rotate_and_store(x1, x2, cos, sin, slot, offs_m, M, head, offs_d, Y, KBuf, VBuf, stride_ym,
                      stride_kb, stride_vb, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, COMPILED: tl.constexpr):
    """x1 / x2 [BLOCK_M, P]: the rows' qkv outputs (rounded, bias in) at columns d and d + half
    of `head` (d = offs_d). q and k heads rotated as the rotary kernel does (every product its
    own rounded tensor: HF's bf16 rotary), v heads not; all stored into Y, the keys and values
    also at the rows' KV slots."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = Y.dtype.element_ty
    r1 = _round(_round(x1 * cos, dt, COMPILED) - _round(x2 * sin, dt, COMPILED), dt, COMPILED)
    r2 = _round(_round(x2 * cos, dt, COMPILED) + _round(x1 * sin, dt, COMPILED), dt, COMPILED)
    rotated = head < Q_HEADS + KV_HEADS
    o1 = tl.where(rotated, r1, x1)
    o2 = tl.where(rotated, r2, x2)
    m_ok = (offs_m < M)[:, None] & (offs_d < HALF)[None, :]
    y = Y + offs_m[:, None] * stride_ym + head * HEAD_DIM + offs_d[None, :]
    tl.store(y, o1, mask=m_ok)
    tl.store(y + HALF, o2, mask=m_ok)
    kv_head = head - Q_HEADS  # keys: 0 .. KV_HEADS - 1, values: KV_HEADS .. 2·KV_HEADS - 1
    kv_heads = tl.full(o1.shape, kv_head, tl.int32)  # tensor masks (the interpreter's)
    is_k = m_ok & (kv_heads >= 0) & (kv_heads < KV_HEADS)
    is_v = m_ok & (kv_heads >= KV_HEADS)
    kb = KBuf + slot[:, None] * stride_kb + kv_head * HEAD_DIM + offs_d[None, :]
    vb = VBuf + slot[:, None] * stride_vb + (kv_head - KV_HEADS) * HEAD_DIM + offs_d[None, :]
    tl.store(kb, o1.to(KBuf.dtype.element_ty), mask=is_k)
    tl.store(kb + HALF, o2.to(KBuf.dtype.element_ty), mask=is_k)
    tl.store(vb, o1.to(VBuf.dtype.element_ty), mask=is_v)
    tl.store(vb + HALF, o2.to(VBuf.dtype.element_ty), mask=is_v)


def fused_config(x: torch.Tensor, weight: torch.Tensor,
                 heads: QKVHeads) -> Optional[triton_gemv.Config]:
    """The plain GEMM's launch config when this module can take its place, else None: an FMA
    config (one row) or a TMA config (decode batches) not swapped, both unsplit (the epilogue
    needs the whole sums), whose rows per program pair up within a head's half (a Gluon entry:
    None where this GPU runs it, else the entry it replaced).
    The caller has checked `triton_gemv.supports` (so TMA can read x and the weight)."""
    if not (FUSED_QKV_ROPE != "0" and heads.dim % 2 == 0
            and weight.shape[0] == (heads.q + 2 * heads.kv) * heads.dim):
        return None
    cfg = triton_gemv._runnable(triton_gemv._config(x.shape[0], weight.shape[0], x.shape[1]),
                                triton_gemv._table_key(x, weight, False), x)
    if cfg is None or cfg.gluon:  # the Gluon GEMM has no rotary epilogue
        return None
    pairs = cfg.block_n // 2
    if cfg.block_n % 2 or (heads.dim // 2) % pairs:
        return None
    if cfg.tma:  # only where the table's config is unsplit: at 32 rows (split in 2) it lost
        return None if cfg.swap_ab or cfg.split_k != 1 or FUSED_QKV_ROPE != "1" else cfg
    if cfg.dot or cfg.split_k != 1 or x.shape[0] > triton_gemv.FMA_MAX_M:
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
    if config.tma:
        _launch_tma(x, weight, bias, out, cos, sin, heads, kv, config)
    else:
        _launch_fma(x, weight, bias, out, cos, sin, heads, kv, config)
    return out


def _launch_fma(x, weight, bias, out, cos, sin, heads: QKVHeads, kv: KVStore,
                config: triton_gemv.Config) -> None:
    M, K = x.shape
    pairs = config.block_n // 2
    _, k_split = triton_gemv.split_k_range(K, config)  # whole chunks, as the plain GEMV's loop
    preload = max(1, min(config.preload, k_split // config.block_k))
    kb, vb = kv.k_buffer, kv.v_buffer
    _qkv_rope_kernel[((heads.q + 2 * heads.kv) * (heads.dim // 2) // pairs,)](
        x, weight, bias if bias is not None else out, out, cos, sin, kv.loc, kb, vb, M, K, k_split,
        x.stride(0), out.stride(0), cos.stride(0), sin.stride(0), kb.stride(0), vb.stride(0),
        Q_HEADS=heads.q, KV_HEADS=heads.kv, HEAD_DIM=heads.dim, PAIRS=pairs,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_K=config.block_k, EVEN_K=K % config.block_k == 0,
        HAS_BIAS=bias is not None, COMPILED=triton_gemv._COMPILED, PRELOAD=preload,
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False,
        **launch_options(preloads_weights=True))


def _launch_tma(x, weight, bias, out, cos, sin, heads: QKVHeads, kv: KVStore,
                config: triton_gemv.Config) -> None:
    M, K = x.shape
    block_n = config.block_n // 2  # rows a program takes from each half of a head
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, config.block_k])
    tiles = (heads.q + 2 * heads.kv) * (heads.dim // 2) // block_n
    kb, vb = kv.k_buffer, kv.v_buffer
    _qkv_rope_tma_kernel[(triton.cdiv(M, config.block_m) * tiles,)](
        x_desc, w_desc, weight, bias if bias is not None else out, out, cos, sin, kv.loc, kb, vb,
        M, K, triton.cdiv(K, config.block_k) * config.block_k, out.stride(0), cos.stride(0),
        sin.stride(0), kb.stride(0), vb.stride(0),
        Q_HEADS=heads.q, KV_HEADS=heads.kv, HEAD_DIM=heads.dim, BLOCK_M=config.block_m,
        BLOCK_N=block_n, BLOCK_K=config.block_k, HAS_BIAS=bias is not None,
        COMPILED=triton_gemm_tma._COMPILED, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        PREFETCH_K=config.prefetch_k, num_warps=config.num_warps, num_stages=config.num_stages,
        enable_fp_fusion=False, **launch_options())


__all__ = ["qkv_rope", "fused_config", "QKVHeads", "FUSED_QKV_ROPE"]
