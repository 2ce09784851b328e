"""Fused Triton kernels for the decoder's elementwise work, used on CUDA tensors only.

A decode step at small batch is dominated by launches, not by math: unfused, every RMSNorm is
a handful of kernels (cast, pow, mean, add, rsqrt, mul, cast, mul), and every residual add,
rotary and SiLU gate several more. Here each is one kernel: `fused_add_rms_norm` (residual add +
RMSNorm; `split_add_rms_norm` when the added GEMM output is still split-K partials, which it
sums first), `rms_norm` (also per head, for Qwen3's q/k norms, in place if asked), `silu_and_mul`
and `apply_rotary_inplace` (q and k heads together; optionally storing the new keys and
values into the KV cache in the same launch, optionally computing qkv first from its GEMM's
split-K partials, a SplitSum, and optionally RMS-norming each head first, Qwen3's q/k norms).
The CPU path stays plain torch (the HF-exact reference); this module is imported lazily on
first GPU use, so triton stays optional and a CPU test process can still turn the interpreter on
(TRITON_INTERPRET=1) before the kernels are decorated. No host syncs and no data-dependent
sizes: every op can be captured in a CUDA graph.

Rounding: each kernel repeats the roundings of the torch expression it replaces (bf16/fp16
values are computed in fp32 and rounded, to nearest even, wherever torch rounds an intermediate
tensor; no FMA contraction, as in torch's separate kernels):
  * residual sum `x + residual`: fp32 add, one rounding: bitwise equal to torch.
  * RMSNorm `weight * (x_f32 * rsqrt(mean(x_f32²) + eps)).to(dtype)`: the same ops (rsqrt is
    libdevice's rsqrtf, as torch's CUDA rsqrt), but the mean is summed in another order than
    torch's reduction and can differ in its last fp32 bits. Where that flips the rounding of
    x·rsqrt (rare: the product must lie within a few fp32 ulps of a bf16 midpoint) the output
    differs by ≤ 2 bf16 ulps (1 ulp before the weight product); every other element is exact.
  * `silu(gate).to(dtype) * up`: on a GPU exp and division are libdevice's expf and IEEE
    division, as in torch's CUDA silu, so results are meant to equal torch's bit for bit
    (denormals aside: Triton flushes them). Under the CPU interpreter numpy's exp stands in for
    expf and may differ in its last fp32 bit (≤ 2 bf16 ulps after rounding, if it flips one).
  * rotary `cat(x1·cos − x2·sin, x2·cos + x1·sin)`: each product rounded, then the sum
    rounded: bitwise equal to torch.
In fp32 every op equals torch's up to the RMSNorm summation order (and, in the interpreter,
numpy's exp).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rollout.layers.split_sum import SplitSum
from rollout.triton_pdl import launch_options, pdl_wait

MAX_HIDDEN = 16384  # one program holds a whole row
# Qwen3's q/k norms inside the rotary kernel (ROLLOUT_FUSED_QK_NORM=0: two rms_norm launches
# before it, the A/B's other side)
FUSED_QK_NORM = os.environ.get("ROLLOUT_FUSED_QK_NORM", "1") != "0"


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 256))


# A decode step's norm is one program a row, at most two an SM (a CUDA graph's batch is at most
# 256 rows), on the step's critical path: more warps, fewer of a row's elements a thread
# (eighteenth session, 1,536-wide rows. One row, 16 warps instead of 8: batch-1 decode graph
# 1.0212 -> 1.0148 ms, 4 warps 1.0278, 32 warps 1.0219 (benchmarks/ab_eighteenth_session_b.json,
# _c). Decode batches, 16 warps: batch 32 1.5342 -> 1.5222, batch 128 1.8364 -> 1.7952 (_d);
# 32: 1.5022 -> 1.4981 and 1.7920 -> 1.7844 (_e)). Prefill chunks keep 8, and rows narrower
# than a hidden state (Qwen3's per-head q/k norms) their measured launch.
FEW_ROWS_NORM_PROGRAMS = 256
FEW_ROWS_NORM_MIN_BLOCK = 1024
ONE_ROW_NORM_ELEMENTS_PER_THREAD = 4
FEW_ROWS_NORM_ELEMENTS_PER_THREAD = 2


def _norm_warps(block: int, programs: int) -> int:
    if programs > FEW_ROWS_NORM_PROGRAMS or block < FEW_ROWS_NORM_MIN_BLOCK:
        return _num_warps(block)
    per_thread = (ONE_ROW_NORM_ELEMENTS_PER_THREAD if programs == 1
                  else FEW_ROWS_NORM_ELEMENTS_PER_THREAD)
    return min(32, max(1, block // (32 * per_thread)))


@triton.jit
def _round(x, dtype: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 x rounded to `dtype` (to nearest even, as torch casts) and returned as fp32."""
    if COMPILED or dtype != tl.bfloat16:
        return x.to(dtype).to(tl.float32)
    else:  # the interpreter truncates fp32 -> bf16: round by hand (stores then truncate exactly)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def bulk_prefetch_l2(addr, size, valid):
    """Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2`) of `size` bytes at each byte
    address in `addr` where `valid` is nonzero, one instruction an element (16-byte units and
    alignment): a hint, it changes no value. Compiled kernels only (inline PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, size, valid.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# ---- RMSNorm (optionally after the residual add) -------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    X, Residual, Weight, Out, ResidualOut, eps, inv_n,
    stride_x0, stride_x1, stride_r, stride_o0, stride_o1, INNER, stride_split,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
    COMPILED: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # rows are [outer, inner] pairs (inner: a head, or 1)
    outer, inner = row // INNER, row % INNER
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    # The weight is no earlier kernel's output: loaded before the wait, it is not a memory
    # latency after the reduction
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    dt = Residual.dtype.element_ty  # the data's dtype (Residual is X when there is none)
    x_ptr = X + outer * stride_x0 + inner * stride_x1 + offs
    if SPLIT > 1:  # X: a GEMM's fp32 split-K partials, summed as triton_gemv's reduce kernel does
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(x_ptr + s * stride_split, mask=mask, other=0.0)
        x = _round(acc, dt, COMPILED)
    else:
        x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the sum is rounded to the input dtype, and the norm reads the rounded sum
        res = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        xf = _round(x + res.to(tl.float32), dt, COMPILED)
        tl.store(ResidualOut + row * N + offs, xf, mask=mask)
    else:
        xf = x
    var = tl.sum(xf * xf, axis=0) * inv_n
    if COMPILED:
        r = libdevice.rsqrt(var + eps)
    else:  # the interpreter has no libdevice
        r = tl.math.rsqrt(var + eps)
    y = _round(xf * r, dt, COMPILED)
    tl.store(Out + outer * stride_o0 + inner * stride_o1 + offs,
             _round(y * w, Out.dtype.element_ty, COMPILED), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [outer, inner, n] view of a [rows, n] or [rows, heads, n] tensor."""
    if t.dim() not in (2, 3) or t.stride(-1) != 1:
        raise ValueError(f"expected a [rows, n] or [rows, heads, n] tensor contiguous in its last "
                         f"dim, got shape {tuple(t.shape)} strides {t.stride()}")
    return t if t.dim() == 3 else t.unsqueeze(1)


def _launch_rms_norm(x, residual, weight, eps, out, residual_out, splits: int = 1) -> None:
    """x: [rows, n] or [rows, heads, n]; or, with splits > 1, fp32 partials [splits, rows, n]."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {n}")
    if n > MAX_HIDDEN:
        raise ValueError(f"rows of {n} exceed MAX_HIDDEN={MAX_HIDDEN}")
    if out.numel() == 0:
        return
    o3 = _rows(out)
    if splits > 1:  # [splits, rows, n]: a row's partials are a split stride apart
        x3, x_strides = x, (x.stride(1), 0, x.stride(0))
    else:
        x3 = _rows(x)
        x_strides = (x3.stride(0), x3.stride(1), 0)
    block = triton.next_power_of_2(n)
    has_res = residual is not None
    stride_x0, stride_x1, stride_split = x_strides
    programs = o3.shape[0] * o3.shape[1]
    _rms_norm_kernel[(programs,)](
        x3, residual if has_res else x3, weight, o3, residual_out if has_res else o3,
        eps, 1.0 / n, stride_x0, stride_x1, residual.stride(0) if has_res else 0,
        o3.stride(0), o3.stride(1), o3.shape[1], stride_split,
        N=n, BLOCK=block, HAS_RESIDUAL=has_res, SPLIT=splits, COMPILED=_COMPILED,
        num_warps=_norm_warps(block, programs), enable_fp_fusion=False, **launch_options())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """HF's RMSNorm over the last dim of x ([rows, n], or [rows, heads, n] for per-head norms;
    strided rows are fine). `out` may be x itself (in place)."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} does not match x {tuple(x.shape)}")
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [rows, n] tensors of one dtype, one kernel."""
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} "
                         f"{residual.dtype} must be [rows, n] of one dtype")
    if residual.stride(-1) != 1:
        raise ValueError("residual must be contiguous in its last dim")
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, new_residual)
    return out, new_residual


def split_add_rms_norm(x: SplitSum, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm of a GEMM output still in split-K partials: the kernel sums them as
    the reduce kernel would (split order, rounded once to the residual's dtype) before the add,
    so the results are those of fused_add_rms_norm(x.tensor(), ...) bit for bit."""
    if residual.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"partials of {tuple(x.shape)} {x.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} must be [rows, n] of one dtype")
    if residual.stride(-1) != 1 or x.partials.device != residual.device:
        raise ValueError("residual must be contiguous in its last dim, on the partials' device")
    if x.bias is not None:
        raise ValueError("partials with a bias: sum them first (SplitSum.tensor())")
    new_residual = torch.empty(residual.shape, dtype=x.dtype, device=residual.device)
    out = torch.empty(residual.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=residual.device)
    _launch_rms_norm(x.partials, residual, weight, eps, out, new_residual, splits=x.splits)
    return out, new_residual


# ---- SiLU gate ------------------------------------------------------------------------------------
SILU_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, I, BLOCK: tl.constexpr, COMPILED: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    if COMPILED:
        e = libdevice.exp(-gate)  # expf, as torch's CUDA silu (tl.exp would be ex2.approx)
    else:
        e = tl.exp(-gate)
    dt = X.dtype.element_ty
    silu = _round(tl.math.div_rn(gate, 1.0 + e), dt, COMPILED)
    tl.store(Out + row * I + offs, _round(silu * up, dt, COMPILED), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2·I] laid out [gate | up] → silu(gate) · up, [rows, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"expected [rows, 2·I] contiguous in its last dim, got "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, COMPILED=_COMPILED,
        num_warps=_num_warps(block), enable_fp_fusion=False, **launch_options())
    return out


# ---- rotary ---------------------------------------------------------------------------------------
@triton.jit
def _split_sum(P, Bias, offs, cols, stride_split, mask, acc, SPLIT: tl.constexpr,
               HAS_BIAS: tl.constexpr, dt: tl.constexpr, COMPILED: tl.constexpr):
    """A GEMM's output values at `offs` from its fp32 split-K partials: summed in split order
    onto `acc` (zeros), + the bias at `cols`, rounded once — triton_gemv's reduce kernel's sum."""
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * stride_split + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=mask, other=0.0).to(tl.float32)
    return _round(acc, dt, COMPILED)


@triton.jit
def _rotary_kernel(
    X, Cos, Sin, stride_xt, stride_xh, stride_ct, stride_st, H,
    V, Loc, KBuf, VBuf, stride_vt, stride_kb, stride_vb, Q_HEADS,
    P, Bias, stride_pt, stride_ps, QNormW, KNormW, NORM_Q_HEADS, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, COMPILED: tl.constexpr,
    STORE_KV: tl.constexpr, KV_ROW: tl.constexpr, BLOCK_KV: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    mask = (offs_h < H)[:, None] & d_mask[None, :]
    # The step's inputs (written before its first kernel, or by it: cos and sin, complete before
    # the first layer's norm lets its successor launch, DecoderLayer.forward): before the wait
    cos = tl.load(Cos + t * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if STORE_KV:
        slot = tl.load(Loc + t).to(tl.int64)
    if QK_NORM:  # a head's norm weight halves: q_norm's for the query heads, k_norm's after
        is_q = (offs_h < NORM_Q_HEADS)[:, None]
        qw1 = tl.load(QNormW + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        qw2 = tl.load(QNormW + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kw1 = tl.load(KNormW + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        kw2 = tl.load(KNormW + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w1 = tl.where(is_q, qw1, kw1)
        w2 = tl.where(is_q, qw2, kw2)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    p1 = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    dt = X.dtype.element_ty  # every product is its own rounded tensor in torch
    if SPLIT > 1:  # x not written yet: the qkv GEMM's partials (heads at h · head_dim in a row)
        cols = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        zeros = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        x1 = _split_sum(P, Bias, t * stride_pt + cols, cols, stride_ps, mask, zeros, SPLIT,
                        HAS_BIAS, dt, COMPILED)
        x2 = _split_sum(P, Bias, t * stride_pt + cols + HALF, cols + HALF, stride_ps, mask, zeros,
                        SPLIT, HAS_BIAS, dt, COMPILED)
    else:
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3's per-head RMSNorm, with rms_norm's roundings, before the rotation
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * (1.0 / (2 * HALF))
        if COMPILED:
            r = libdevice.rsqrt(var + eps)[:, None]
        else:  # the interpreter has no libdevice
            r = tl.math.rsqrt(var + eps)[:, None]
        x1 = _round(_round(x1 * r, dt, COMPILED) * w1, dt, COMPILED)
        x2 = _round(_round(x2 * r, dt, COMPILED) * w2, dt, COMPILED)
    o1 = _round(_round(x1 * cos, dt, COMPILED) - _round(x2 * sin, dt, COMPILED), dt, COMPILED)
    o2 = _round(_round(x2 * cos, dt, COMPILED) + _round(x1 * sin, dt, COMPILED), dt, COMPILED)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    if STORE_KV:  # the rotated key heads into the token's KV slot
        kv_head = offs_h - Q_HEADS
        k_mask = mask & (kv_head >= 0)[:, None]
        kb = KBuf + slot * stride_kb + kv_head[:, None] * (2 * HALF) + offs_d[None, :]
        kdt = KBuf.dtype.element_ty
        tl.store(kb, o1.to(kdt), mask=k_mask)
        tl.store(kb + HALF, o2.to(kdt), mask=k_mask)
    if (STORE_KV or SPLIT > 1) and tl.program_id(1) == 0:  # the token's values, once
        offs_v = tl.arange(0, BLOCK_KV)
        v_mask = offs_v < KV_ROW
        if SPLIT > 1:  # summed from the partials (after the H heads) and written to V
            v_cols = H * (2 * HALF) + offs_v
            v = _split_sum(P, Bias, t * stride_pt + v_cols, v_cols, stride_ps, v_mask,
                           tl.zeros([BLOCK_KV], dtype=tl.float32), SPLIT, HAS_BIAS, dt, COMPILED)
            tl.store(V + t * stride_vt + offs_v, v, mask=v_mask)
        else:
            v = tl.load(V + t * stride_vt + offs_v, mask=v_mask)
        if STORE_KV:
            tl.store(VBuf + slot * stride_vb + offs_v, v.to(VBuf.dtype.element_ty), mask=v_mask)


class QKNorm(NamedTuple):
    """Qwen3's per-head q/k RMSNorms, applied by `apply_rotary_inplace` before the rotation: x's
    first `q_heads` heads take `q_weight`, the rest `k_weight` (both [head_dim])."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    q_heads: int


class KVStore(NamedTuple):
    """Where `apply_rotary_inplace` also writes a step's keys and values: the last kv heads of
    x are the keys; `v` [T, kv_heads, head_dim] (rows contiguous), `loc` [T] KV slots, and the
    layer's [slots, kv_heads, head_dim] buffers (cast to their dtype on the way)."""
    v: torch.Tensor
    loc: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor


def apply_rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv: Optional[KVStore] = None, source: Optional[SplitSum] = None,
                         qk_norm: Optional[QKNorm] = None) -> torch.Tensor:
    """rotary.apply_rotary, written into x ([T, heads, head_dim], strided tokens and heads are
    fine); cos/sin [T, 1, head_dim / 2] of x's dtype. Returns x. With `kv`, the same launch
    stores the rotated keys (x's last kv heads) and the values into the KV cache, as
    `TokenToKVPool.set_kv` would: one kernel a layer fewer. With `source` (the qkv GEMM's
    split-K partials, + bias), x is not written yet: it is the leading heads of `source.out`,
    whose every column (x's, then the values') the kernel first sums as the GEMM's reduce kernel
    would have. With `qk_norm`, every head is first RMS-normed as `rms_norm` would (Qwen3): two
    kernels a layer fewer, and the norm reads the summed partials, so qkv may stay split."""
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[2] % 2:
        raise ValueError(f"expected [T, heads, even head_dim] contiguous in head_dim, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    t, heads, half = x.shape[0], x.shape[1], x.shape[2] // 2
    for c in (cos, sin):
        if c.shape != (t, 1, half) or c.dtype != x.dtype or c.stride(2) != 1:
            raise ValueError(f"cos/sin {tuple(c.shape)} {c.dtype} do not fit x {tuple(x.shape)} "
                             f"{x.dtype}")
    if kv is not None:
        _check_kv_store(x, kv)
    if qk_norm is not None:
        _check_qk_norm(x, qk_norm)
    v = _source_values(x, source) if source is not None else (kv.v if kv is not None else None)
    if x.numel() == 0:
        return x
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(heads), max(1, 2048 // block_d))
    if kv is not None:
        store = (v, kv.loc, kv.k_buffer, kv.v_buffer, v.stride(0), kv.k_buffer.stride(0),
                 kv.v_buffer.stride(0), heads - v.shape[1])
    elif v is not None:
        store = (v, x, x, x, v.stride(0), 0, 0, heads)
    else:
        store = (x, x, x, x, 0, 0, 0, heads)
    kv_row = v.shape[1] * v.shape[2] if v is not None else 1
    if source is not None:
        split = (source.partials, source.bias if source.bias is not None else source.partials,
                 source.partials.stride(1), source.partials.stride(0))
    else:
        split = (x, x, 0, 0)
    norm = ((qk_norm.q_weight, qk_norm.k_weight, qk_norm.q_heads, qk_norm.eps)
            if qk_norm is not None else (x, x, 0, 0.0))
    _rotary_kernel[(t, triton.cdiv(heads, block_h))](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), heads, *store,
        *split, *norm, HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, COMPILED=_COMPILED,
        STORE_KV=kv is not None, KV_ROW=kv_row, BLOCK_KV=triton.next_power_of_2(kv_row),
        SPLIT=source.splits if source is not None else 1,
        HAS_BIAS=source is not None and source.bias is not None, QK_NORM=qk_norm is not None,
        num_warps=_num_warps(block_h * block_d), enable_fp_fusion=False, **launch_options())
    return x


def _source_values(x: torch.Tensor, source: SplitSum) -> torch.Tensor:
    """The values view [T, kv_heads, D] of `source.out` [T, (H + kv_heads) · D], whose leading
    heads x [T, H, D] must be (the qkv output the rotary kernel writes from the partials)."""
    out = source.out
    t, heads, dim = x.shape
    kv_cols = out.shape[1] - heads * dim if out.dim() == 2 else 0
    if (out.dim() != 2 or out.shape[0] != t or kv_cols <= 0 or kv_cols % dim
            or source.dtype != x.dtype or x.data_ptr() != out.data_ptr()
            or (t > 1 and x.stride(0) != out.stride(0)) or x.stride(1) != dim):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} is not the leading heads of the source's "
                         f"qkv output {tuple(out.shape)} {source.dtype}")
    return out[:, heads * dim:].view(t, kv_cols // dim, dim)


def _check_qk_norm(x: torch.Tensor, norm: QKNorm) -> None:
    dim = x.shape[2]
    for w in (norm.q_weight, norm.k_weight):
        if w.shape != (dim,) or w.device != x.device or w.stride(0) != 1:
            raise ValueError(f"q/k norm weight {tuple(w.shape)} on {w.device} does not fit heads "
                             f"of {dim} on {x.device}")
    if not 0 < norm.q_heads < x.shape[1]:
        raise ValueError(f"q/k norm: {norm.q_heads} query heads of x's {x.shape[1]}")


def _check_kv_store(x: torch.Tensor, kv: KVStore) -> None:
    t, heads, dim = x.shape
    v, kb, vb = kv.v, kv.k_buffer, kv.v_buffer
    kv_heads = v.shape[1] if v.dim() == 3 else 0
    if (v.dim() != 3 or v.shape[0] != t or v.shape[2] != dim or not 1 <= kv_heads <= heads
            or v.stride(2) != 1 or v.stride(1) != dim
            or kb.shape[1:] != (kv_heads, dim) or vb.shape[1:] != (kv_heads, dim)
            or not kb.is_contiguous() or not vb.is_contiguous()
            or kv.loc.shape != (t,) or kv.loc.device != x.device):
        raise ValueError(f"KV store does not fit x {tuple(x.shape)}: v {tuple(v.shape)} "
                         f"strides {v.stride()}, buffers {tuple(kb.shape)} / {tuple(vb.shape)} "
                         f"(contiguous [slots, kv_heads, head_dim]), loc {tuple(kv.loc.shape)}")


def _is_compiled(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return not isinstance(kernel, InterpretedFunction)


_COMPILED = _is_compiled(_rms_norm_kernel)  # False under TRITON_INTERPRET=1

__all__ = ["fused_add_rms_norm", "split_add_rms_norm", "rms_norm", "silu_and_mul",
           "apply_rotary_inplace", "KVStore", "QKNorm", "MAX_HIDDEN"]
