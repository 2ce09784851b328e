"""One row's residual add + RMSNorm folded into its qkv + rotary + KV-store kernel (decode).

Why: at batch 1 a decoder layer is a chain of short kernels, and the add + RMSNorm before the
attention is one of them: it waits for down, reads down's split-K partials and the residual,
reduces the row, writes the normed row, completes — and only then can qkv's programs, their
weights long loaded, read that row. Here every qkv program does the norm itself on the one row
(1,536 values: the partials and the residual are a few KB from L2) and multiplies its preloaded
weight rows by it, so one completion and one round trip of the row through memory leave the
chain. The fifth session's fold into every GEMV program lost (4,480 gate/up programs re-reading
the row while their weights streamed); here the weights are loaded before the PDL wait and the
programs are few (a config of several rotation pairs a program). `norm_qkv` is the same kernel
without its rotary epilogue, for Qwen3, whose q/k norms come between qkv and the rotary (they
stay in the rotary kernel after it).

Rounding: the norm kernel's (`triton_ops._rms_norm_kernel`: partials summed in split order and
rounded, the residual added and rounded, fp32 mean of squares, rsqrt, two roundings), but the
mean's sum runs in another order than that kernel's, so an element of the normed row can differ
in its last bit where x·rsqrt lies within fp32 ulps of a bf16 midpoint (as that kernel may
differ from torch's). The qkv sums, the rotary and the stores are `triton_qkv_rope`'s at one row,
the same bits for the same normed row. The new residual (the rounded sum) is exact: program 0
writes it.

ROLLOUT_FUSED_NORM_QKV: "PAIRS,WARPS" — rotation pairs a program (2·PAIRS weight rows) and its
warps; default "2,4" — or "0" off. On an H200 (thirty-fifth session, Qwen2-1.5B shapes, batch-1
decode graph, engine alone; benchmarks/ab_thirtyfifth_session*.json): 1.0043 -> 0.9967 ms
(ab35a), 1.0040 -> 0.9990 (ab35b, two rounds), 1.0045 -> 0.9962 (ab35c, two rounds); one
pair a program 1.0012-1.0014, four 1.0077-1.0128, eight 1.0134; two pairs with 2 or 8 warps
1.0027 / 1.0085. The bound, the norm without any kernel, 0.9887. In the decode benchmark's
process of batches 1, 32 and 128 only 1.0056 -> 1.0041 (ab35d, two rounds). The same fold into the one-row
gate/up (4,480 programs) lost 12% (1.0045 -> 1.1243 ms, ab35c), as the fifth session's had.
Qwen3-1.7B's `norm_qkv` (fortieth session, benchmarks/ab_fortieth_session_d.json, three
rounds): 1.1232 -> 1.1151 ms; with the older, split down entry before it, it had lost (1.2117 ->
1.2168, ab_fortieth_session.json)."""
from __future__ import annotations

import os
from typing import NamedTuple, Optional, Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rollout.layers import triton_gemv
from rollout.layers.split_sum import SplitSum
from rollout.layers.triton_ops import KVStore, _round
from rollout.layers.triton_qkv_rope import QKVHeads, _rotate_and_store, _step_inputs
from rollout.triton_pdl import launch_options, pdl_wait


class NormQKVConfig(NamedTuple):
    pairs: int  # rotation pairs a program: 2·pairs weight rows
    num_warps: int


def _parse(spec: str) -> Optional[NormQKVConfig]:
    if spec == "0":
        return None
    try:
        pairs, warps = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"ROLLOUT_FUSED_NORM_QKV={spec!r}: 0 or PAIRS,WARPS") from None
    if pairs < 1 or pairs & (pairs - 1) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"ROLLOUT_FUSED_NORM_QKV={spec!r}: powers of two")
    return NormQKVConfig(pairs, warps)


CONFIG = _parse(os.environ.get("ROLLOUT_FUSED_NORM_QKV", "2,4"))
MAX_CHUNKS = 3  # the whole row is held in at most three K chunks (K = 1,536 = 3 × 512)


@triton.jit
def _added_chunk(X, Residual, offs, stride_split, SPLIT: tl.constexpr, dt: tl.constexpr,
                 COMPILED: tl.constexpr):
    """The residual stream's new values at `offs`: the branch output (its fp32 split-K partials
    summed in split order and rounded, or the tensor itself) + the residual, rounded."""
    if SPLIT > 1:
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(X + s * stride_split + offs)
        x = _round(acc, dt, COMPILED)
    else:
        x = tl.load(X + offs).to(tl.float32)
    return _round(x + tl.load(Residual + offs).to(tl.float32), dt, COMPILED)


@triton.jit
def _normed(h, r, nw, dt: tl.constexpr, COMPILED: tl.constexpr):
    return _round(_round(h * r, dt, COMPILED) * nw, dt, COMPILED)


@triton.jit
def _norm_qkv_rope_kernel(
    X, Residual, NormW, ResidualOut, W, Bias, Y, Cos, Sin, Loc, KBuf, VBuf, eps, inv_n, K,
    stride_split, stride_ct, stride_st, stride_kb, stride_vb,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr,
    BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROPE: tl.constexpr, COMPILED: tl.constexpr, USE_PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    per_head = HALF // PAIRS
    head = tl.program_id(0) // per_head
    d0 = (tl.program_id(0) % per_head) * PAIRS
    offs_j = tl.arange(0, 2 * PAIRS)  # as triton_qkv_rope: pair j // 2, low or high half j % 2
    rows_n = (head * HEAD_DIM + d0 + offs_j // 2 + (offs_j % 2) * HALF).to(tl.int64)
    offs_m = tl.arange(0, 1)
    offs_d = d0 + tl.arange(0, PAIRS)
    kk = tl.arange(0, BLOCK_K)[None, None, :]  # [1, 1, BK]: the row's chunk, as x in the GEMV
    if ROPE:
        cos, sin, slot = _step_inputs(Cos, Sin, Loc, offs_m, offs_d, stride_ct, stride_st)
    if HAS_BIAS:
        bias = tl.load(Bias + rows_n).to(tl.float32)
    # weights (qkv's and the norm's): no earlier kernel's output, loaded before the wait
    w_ptr = W + rows_n[None, :, None] * K + kk  # [1, 2·PAIRS, BK]
    w0 = tl.load(w_ptr).to(tl.float32)
    nw0 = tl.load(NormW + kk).to(tl.float32)
    if CHUNKS >= 2:
        w1 = tl.load(w_ptr + BLOCK_K).to(tl.float32)
        nw1 = tl.load(NormW + BLOCK_K + kk).to(tl.float32)
    if CHUNKS >= 3:
        w2 = tl.load(w_ptr + 2 * BLOCK_K).to(tl.float32)
        nw2 = tl.load(NormW + 2 * BLOCK_K + kk).to(tl.float32)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    dt = Residual.dtype.element_ty
    first = (kk * 0 + tl.program_id(0)) == 0  # a tensor mask (the interpreter's)
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
    else:  # the interpreter has no libdevice
        r = tl.math.rsqrt(var + eps)
    # the GEMV's sums (fma_row_sums with the row preloaded whole): x·w chunk by chunk, then K
    acc = _normed(h0, r, nw0, dt, COMPILED) * w0
    if CHUNKS >= 2:
        acc += _normed(h1, r, nw1, dt, COMPILED) * w1
    if CHUNKS >= 3:
        acc += _normed(h2, r, nw2, dt, COMPILED) * w2
    acc = tl.sum(acc, axis=2)  # [1, 2·PAIRS]
    if HAS_BIAS:
        acc += bias[None, :]
    out = _round(acc, Y.dtype.element_ty, COMPILED)
    if ROPE:
        x1, x2 = tl.split(tl.reshape(out, [1, PAIRS, 2]))
        _rotate_and_store(x1, x2, cos, sin, slot, offs_m, 1, head, offs_d, Y, KBuf, VBuf, 0,
                          stride_kb, stride_vb, Q_HEADS, KV_HEADS, HEAD_DIM, COMPILED)
    else:  # qkv as the plain GEMV writes it (Qwen3: its q/k norms come before the rotary)
        tl.store(Y + rows_n[None, :], out)


def row_chunks(k: int) -> Optional[tuple[int, int]]:
    """(K chunk, chunks) holding a row of k values whole in at most MAX_CHUNKS power-of-two
    chunks, or None."""
    for chunks in range(1, MAX_CHUNKS + 1):
        block = k // chunks
        if k % chunks == 0 and block & (block - 1) == 0:
            return block, chunks
    return None


def applies(h: Union[torch.Tensor, SplitSum], residual: torch.Tensor, norm_weight: torch.Tensor,
            weight: torch.Tensor, heads: QKVHeads, config: Optional[NormQKVConfig]) -> bool:
    """Whether the fused kernel with `config` (None: off; the engine passes CONFIG) can take
    (add + norm, qkv + rotary + KV store) for this row."""
    if config is None or not residual.is_cuda or residual.shape[0] != 1:
        return False
    if isinstance(h, SplitSum) and h.bias is not None:
        return False
    if not isinstance(h, SplitSum) and h.stride(-1) != 1:
        return False
    k = residual.shape[1]
    return (h.shape == residual.shape and h.dtype == residual.dtype == norm_weight.dtype
            == weight.dtype and residual.is_contiguous() and row_chunks(k) is not None
            and weight.shape == ((heads.q + 2 * heads.kv) * heads.dim, k)
            and weight.is_contiguous() and heads.dim % 2 == 0
            and (heads.dim // 2) % config.pairs == 0)


def norm_qkv_rope(h: Union[torch.Tensor, SplitSum], residual: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                  bias: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  heads: QKVHeads, kv: KVStore, out: torch.Tensor,
                  config: NormQKVConfig) -> torch.Tensor:
    """`triton_qkv_rope.qkv_rope(rms_norm(h + residual), ...)` for one row, into `out`; returns
    the new residual h + residual. h: a GEMM output, possibly still split-K partials. The caller
    has checked `applies`."""
    half = heads.dim // 2
    for c in (cos, sin):
        if c.shape != (1, 1, half) or c.dtype != residual.dtype or c.stride(2) != 1:
            raise ValueError(f"cos/sin {tuple(c.shape)} {c.dtype} do not fit one row of "
                             f"{heads.dim}-dim heads in {residual.dtype}")
    return _launch(h, residual, norm_weight, eps, weight, bias, heads, out, config,
                   (cos, sin, kv))


def norm_qkv(h: Union[torch.Tensor, SplitSum], residual: torch.Tensor, norm_weight: torch.Tensor,
             eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor], heads: QKVHeads,
             out: torch.Tensor, config: NormQKVConfig) -> torch.Tensor:
    """`F.linear(rms_norm(h + residual), weight, bias)` for one row, into `out`, neither rotated
    nor stored (Qwen3: the q/k norms come between qkv and the rotary, in the rotary kernel);
    returns the new residual h + residual. The caller has checked `applies`."""
    return _launch(h, residual, norm_weight, eps, weight, bias, heads, out, config, None)


def _launch(h: Union[torch.Tensor, SplitSum], residual: torch.Tensor, norm_weight: torch.Tensor,
            eps: float, weight: torch.Tensor, bias: Optional[torch.Tensor], heads: QKVHeads,
            out: torch.Tensor, config: NormQKVConfig,
            rope: Optional[tuple[torch.Tensor, torch.Tensor, KVStore]]) -> torch.Tensor:
    block_k, chunks = row_chunks(residual.shape[1])
    if out.shape != (1, weight.shape[0]) or out.dtype != residual.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} is not a contiguous "
                         f"[1, {weight.shape[0]}] {residual.dtype} tensor")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    x, split, stride_split = ((h.partials, h.splits, h.partials.stride(0))
                              if isinstance(h, SplitSum) else (h, 1, 0))
    new_residual = torch.empty_like(residual)
    # without the rotary its inputs are never read: any tensors stand in for them
    cos, sin, kv = rope if rope is not None else (out, out, KVStore(None, out, out, out))
    kb, vb = kv.k_buffer, kv.v_buffer
    _norm_qkv_rope_kernel[((heads.q + 2 * heads.kv) * (heads.dim // 2) // config.pairs,)](
        x, residual, norm_weight, new_residual, weight, bias if bias is not None else out, out,
        cos, sin, kv.loc, kb, vb, eps, 1.0 / residual.shape[1], residual.shape[1], stride_split,
        cos.stride(0), sin.stride(0), kb.stride(0), vb.stride(0),
        Q_HEADS=heads.q, KV_HEADS=heads.kv, HEAD_DIM=heads.dim, PAIRS=config.pairs,
        BLOCK_K=block_k, CHUNKS=chunks, SPLIT=split, HAS_BIAS=bias is not None,
        ROPE=rope is not None, COMPILED=triton_gemv._COMPILED, num_warps=config.num_warps,
        enable_fp_fusion=False, **launch_options(preloads_weights=True))
    return new_residual


__all__ = ["norm_qkv_rope", "norm_qkv", "applies", "row_chunks", "NormQKVConfig", "CONFIG"]
