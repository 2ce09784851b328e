"""Triton kernels for the decode-time skinny GEMMs: y = x @ W.T with few rows (1 <= M <= MAX_M
from the heuristic config, to BATCH_MAX_M rows where the tuned table has an entry), and the
fused gate/up projection + SiLU.

Why: a small-batch decode step is bound by memory bandwidth, not math — every projection reads
its whole weight to multiply it by a handful of rows. cuBLAS's GEMV/GEMM kernels for such
shapes reach only 55-75% of an H200's bandwidth; these kernels stream each weight row block once,
coalesced along K, and use it for all M rows, so the weight is read exactly once per call.
Decode batches (17..BATCH_MAX_M rows) run the tensor-core kernel tiled along M, only where the
tuned table says it beats cuBLAS (on an H200 the warp-specialized Gluon kernel, `Config.gluon`,
rollout/layers/gluon_gemm.py: the fused gate/up + SiLU at 33-128 rows, and qkv, o and down at
17-128 rows, where cuBLAS's ~5-6 µs is latency, not bandwidth; a GPU without Gluon takes the
TMA-fed entries they replaced, `Config.tma`, triton_gemm_tma; down and o split along K, their
partials summed by the add + norm that reads them, qkv by the rotary kernel; down at 129-256
rows stays on cuBLAS). The caller keeps cuBLAS elsewhere (and everywhere off CUDA); like
triton_ops this module is imported lazily on first GPU use, so a CPU test can turn on
TRITON_INTERPRET=1 first.

Two main kernels, picked by the launch config (`Config.dot`):
  * FMA (`_gemv_fma_kernel`, best at M = 1 and perhaps 2-4): an fp32 [BLOCK_M, BLOCK_N, BLOCK_K]
    accumulator of elementwise products over the K loop, reduced along K once at the end. Its
    loads are plain (not pipelined by Triton), so a thread has one weight chunk in flight:
    `Config.preload` puts more of them before the PDL wait, `Config.lookahead` issues the next
    chunk's load before the FMA on this one (a long K, as down's 8,960, is otherwise short of
    bytes in flight).
  * dot (`_gemv_dot_kernel`): x padded to 16 rows, tensor-core tl.dot per K chunk; also decode
    batches up to BATCH_MAX_M rows, tiled along M (`Config.block_m`), M blocks innermost.
    `Config.dot_preload` loads its first K chunks of the weight before the PDL wait, as the FMA
    kernel's preload (small decode batches, where it runs inside the PDL chain).
Optional split-K (more programs for small N with large K) writes fp32 partials [SPLIT_K, M, N]
and a second kernel sums them in a fixed order: deterministic, no atomics. With `defer_split`
the partials (and the bias) go back to the caller as a SplitSum instead, for the next kernel to
sum (the residual add + RMSNorm after down and o, the rotary kernel after qkv: no reduce kernel,
the same bits).
`skinny_gate_up_silu` is the same GEMM on the fused [gate | up] weight where each program loads
matching gate and up row blocks and writes silu(gate) * up: the [M, 2·I] intermediate is never
written.

The launch config comes from `gemv_launch._config(M, N, K, gated)` (re-exported here): the table
`_TUNED` (pasted from benchmarks/gpu_gemv.py's sweeps and engine A/Bs), else at one row the
pattern its entries share (`gemv_launch.one_row_rule`), else a small deterministic heuristic. No
autotuning, host syncs or data-dependent sizes: every call can be captured in a CUDA graph.

Rounding: products and sums in fp32 (tensor-core dot: bf16/fp16 products exact in fp32; fp32
inputs use IEEE, not TF32), summed in another order than cuBLAS (so not bitwise equal to
F.linear; relative error ~1e-3 in bf16, i.e. rounding of the output). The bias is added in fp32
and the output rounded once to x's dtype. The gated variant rounds as the unfused path does:
gate and up each rounded to the dtype (as a GEMM output), then `silu(gate).to(dtype) * up` as
in triton_ops.silu_and_mul (libdevice expf, IEEE division, no FMA contraction).
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rollout.layers.split_sum import SplitSum
from rollout.layers.triton_ops import _is_compiled, _round
from rollout.triton_pdl import launch_options, pdl_wait

# the launch API, re-exported: callers, tests and benchmarks read it from here
from rollout.layers.gemv_launch import (  # noqa: F401
    BATCH_HEURISTIC, BATCH_MAX_M, FMA_MAX_M, GLUON_FALLBACK, MAX_M, MAX_SPLIT_K, NUM_SMS_H200,
    Config, _TUNED, _config, split_k_range)


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _silu_mul(gate, up, dt: tl.constexpr, COMPILED: tl.constexpr):
    """silu(gate).to(dt) * up, rounded, for fp32 gate/up already rounded to dt (as silu_and_mul)."""
    if COMPILED:
        e = libdevice.exp(-gate)  # expf, as torch's CUDA silu
    else:
        e = tl.exp(-gate)
    silu = _round(tl.math.div_rn(gate, 1.0 + e), dt, COMPILED)
    return _round(silu * up, dt, COMPILED)


@triton.jit
def _epilogue(acc, acc_up, Bias, Y, P, offs_m, offs_n, M, N, stride_ym, pid_k,
              HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr,
              COMPILED: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 sums -> the rounded output, or fp32 partials when split along K."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT > 1:  # partials [SPLIT, M, N] (gated: [SPLIT, M, 2N], up at N + n)
        width = 2 * N if GATED else N
        p = P + (pid_k * M + offs_m[:, None]) * width + offs_n[None, :]
        tl.store(p, acc, mask=mask)
        if GATED:
            tl.store(p + N, acc_up, mask=mask)
    else:
        dt = Y.dtype.element_ty
        if GATED:
            out = _silu_mul(_round(acc, dt, COMPILED), _round(acc_up, dt, COMPILED), dt, COMPILED)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            out = _round(acc, dt, COMPILED)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=mask)


@triton.jit
def _fma_weights(w_ptr, wu_ptr, offs_k, k, K, EVEN_K: tl.constexpr, GATED: tl.constexpr):
    """The FMA kernel's weight tile at K offset k (and the up half's when gated; else zeros)."""
    if EVEN_K:
        w = tl.load(w_ptr + k).to(tl.float32)
        if GATED:
            w_up = tl.load(wu_ptr + k).to(tl.float32)
        else:
            w_up = tl.zeros_like(w)
    else:
        w, w_up = _masked_weights(w_ptr, wu_ptr, k, (offs_k + k < K)[None, None, :], GATED)
    return w, w_up


@triton.jit
def _masked_weights(w_ptr, wu_ptr, k, mask, GATED: tl.constexpr):
    w = tl.load(w_ptr + k, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        w_up = tl.load(wu_ptr + k, mask=mask, other=0.0).to(tl.float32)
    else:
        w_up = tl.zeros_like(w)
    return w, w_up


@triton.jit
def _fma_weights_ahead(w_ptr, wu_ptr, offs_k, k, K, K_SPLIT, EVEN_K: tl.constexpr,
                       GATED: tl.constexpr):
    """`_fma_weights` at K offset k for the loop's next chunk: zeros and no load at all when the
    loop has no such chunk (k >= K_SPLIT), where a clamped offset would re-read one from L2."""
    ok = (offs_k * 0 + k < K_SPLIT)[None, None, :]  # a tensor: the interpreter's masks
    if not EVEN_K:
        ok = ok & (offs_k + k < K)[None, None, :]
    return _masked_weights(w_ptr, wu_ptr, k, ok, GATED)


@triton.jit
def _fma_x(x_ptr, offs_k, k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + k).to(tl.float32)
    return tl.load(x_ptr + k, mask=(offs_k + k < K)[None, None, :], other=0.0).to(tl.float32)


@triton.jit
def fma_row_sums(x_ptr, w_ptr, wu_ptr, offs_k, K, K_SPLIT, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, GATED: tl.constexpr, PRELOAD: tl.constexpr,
                 LOOKAHEAD: tl.constexpr, USE_PDL: tl.constexpr, PIPELINE: tl.constexpr = 0):
    """The FMA kernel's K loop: the [BLOCK_M, BLOCK_N] sums of x·w over this program's K range
    (and of x·w_up when GATED, else zeros), for x_ptr [BM, 1, BK] and w_ptr / wu_ptr [1, BN, BK]
    pointer blocks. Waits for the previous kernel (PDL) after loading the first PRELOAD chunks of
    the weight: the weights are no earlier kernel's output, so under PDL they stream in while the
    previous kernel finishes; x (its output) only after the wait. The loop after the preloaded
    chunks keeps the next chunk in flight in registers (LOOKAHEAD) or, PIPELINE > 1, runs as
    Triton's software pipeline of PIPELINE stages (the same sums in the same order either way)."""
    w, w_up = _fma_weights(w_ptr, wu_ptr, offs_k, 0, K, EVEN_K, GATED)
    if PRELOAD >= 2:
        w1, w1_up = _fma_weights(w_ptr, wu_ptr, offs_k, BLOCK_K, K, EVEN_K, GATED)
    if PRELOAD >= 3:
        w2, w2_up = _fma_weights(w_ptr, wu_ptr, offs_k, 2 * BLOCK_K, K, EVEN_K, GATED)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    start = PRELOAD * BLOCK_K
    if LOOKAHEAD:  # the loop's first chunk goes out now, before the preloaded ones are used
        w_next, wu_next = _fma_weights_ahead(w_ptr, wu_ptr, offs_k, start, K, K_SPLIT, EVEN_K,
                                             GATED)
    x = _fma_x(x_ptr, offs_k, 0, K, EVEN_K)
    acc = x * w
    acc_up = x * w_up
    if PRELOAD >= 2:
        x = _fma_x(x_ptr, offs_k, BLOCK_K, K, EVEN_K)
        acc += x * w1
        if GATED:
            acc_up += x * w1_up
    if PRELOAD >= 3:
        x = _fma_x(x_ptr, offs_k, 2 * BLOCK_K, K, EVEN_K)
        acc += x * w2
        if GATED:
            acc_up += x * w2_up
    if PIPELINE > 1:  # Triton's software pipeline: PIPELINE - 1 chunks in flight through
        # cp.async into shared memory (plain `range` loads feeding no tl.dot are not pipelined)
        for k in tl.range(start, K_SPLIT, BLOCK_K, num_stages=PIPELINE):
            w, w_up = _fma_weights(w_ptr, wu_ptr, offs_k, k, K, EVEN_K, GATED)
            x = _fma_x(x_ptr, offs_k, k, K, EVEN_K)
            acc += x * w
            if GATED:
                acc_up += x * w_up
    else:
        for k in range(start, K_SPLIT, BLOCK_K):
            if LOOKAHEAD:  # two chunks in flight: the next one's load is issued before this FMA
                w, w_up = w_next, wu_next
                w_next, wu_next = _fma_weights_ahead(w_ptr, wu_ptr, offs_k, k + BLOCK_K, K,
                                                     K_SPLIT, EVEN_K, GATED)
            else:
                w, w_up = _fma_weights(w_ptr, wu_ptr, offs_k, k, K, EVEN_K, GATED)
            x = _fma_x(x_ptr, offs_k, k, K, EVEN_K)
            acc += x * w
            if GATED:
                acc_up += x * w_up
    return tl.sum(acc, axis=2), tl.sum(acc_up, axis=2)


@triton.jit(do_not_specialize=["M"])  # one compile for every M of a config
def _gemv_fma_kernel(
    X, W, W_UP, Bias, Y, P, M, N, K, K_SPLIT, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, COMPILED: tl.constexpr,
    PRELOAD: tl.constexpr, LOOKAHEAD: tl.constexpr, PIPELINE: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    # tail rows are clamped, not masked: they re-read a real row, and are never stored
    rows_m = tl.minimum(offs_m, M - 1)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptr = X + rows_m[:, None, None] * stride_xm + offs_k[None, None, :]  # [BM, 1, BK]
    w_ptr = W + rows_n[None, :, None] * K + offs_k[None, None, :]  # [1, BN, BK]
    wu_ptr = W_UP + rows_n[None, :, None] * K + offs_k[None, None, :]  # gated: the up half
    acc, acc_up = fma_row_sums(x_ptr, w_ptr, wu_ptr, offs_k, K, K_SPLIT, BLOCK_K, EVEN_K, GATED,
                               PRELOAD, LOOKAHEAD, USE_PDL, PIPELINE)
    _epilogue(acc, acc_up, Bias, Y, P, offs_m, offs_n, M, N, stride_ym, pid_k, HAS_BIAS, GATED,
              SPLIT, COMPILED)


@triton.jit
def _dot_tile(ptr, offs_k, k, K, EVEN_K: tl.constexpr):
    """A [rows, BLOCK_K] tile of the dot kernel at K offset k (zeros past K)."""
    if EVEN_K:
        return tl.load(ptr + k)
    return tl.load(ptr + k, mask=(offs_k + k < K)[None, :], other=0.0)


@triton.jit
def _dot_step(acc, acc_up, x, w, w_up, GATED: tl.constexpr, PREC: tl.constexpr):
    acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    if GATED:
        acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PREC)
    return acc, acc_up


@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(
    X, W, W_UP, Bias, Y, P, M, N, K, K_SPLIT, stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, COMPILED: tl.constexpr,
    PREC: tl.constexpr, PRELOAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # M blocks innermost: the programs that read one weight block run side by side, so the
    # block comes from HBM once and from L2 for the others (batch-128 decode graph -4%)
    blocks_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = tl.program_id(0) % blocks_m, tl.program_id(0) // blocks_m
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # M blocks: decode batches above 16 rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, M - 1)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptr = X + rows_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    w_ptr = W + rows_n[:, None] * K + offs_k[None, :]  # [BN, BK]
    wu_ptr = W_UP + rows_n[:, None] * K + offs_k[None, :]
    # the first PRELOAD K chunks of the weight (no earlier kernel's output) stream in before
    # the PDL wait, as the FMA kernel's preload (small decode batches)
    if PRELOAD >= 1:
        w0 = _dot_tile(w_ptr, offs_k, 0, K, EVEN_K)
        wu0 = _dot_tile(wu_ptr, offs_k, 0, K, EVEN_K) if GATED else w0
    if PRELOAD >= 2:
        w1 = _dot_tile(w_ptr, offs_k, BLOCK_K, K, EVEN_K)
        wu1 = _dot_tile(wu_ptr, offs_k, BLOCK_K, K, EVEN_K) if GATED else w1
    if PRELOAD >= 3:
        w2 = _dot_tile(w_ptr, offs_k, 2 * BLOCK_K, K, EVEN_K)
        wu2 = _dot_tile(wu_ptr, offs_k, 2 * BLOCK_K, K, EVEN_K) if GATED else w2
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PRELOAD >= 1:
        acc, acc_up = _dot_step(acc, acc_up, _dot_tile(x_ptr, offs_k, 0, K, EVEN_K), w0, wu0,
                                GATED, PREC)
    if PRELOAD >= 2:
        acc, acc_up = _dot_step(acc, acc_up, _dot_tile(x_ptr, offs_k, BLOCK_K, K, EVEN_K), w1,
                                wu1, GATED, PREC)
    if PRELOAD >= 3:
        acc, acc_up = _dot_step(acc, acc_up, _dot_tile(x_ptr, offs_k, 2 * BLOCK_K, K, EVEN_K),
                                w2, wu2, GATED, PREC)
    for k in range(PRELOAD * BLOCK_K, K_SPLIT, BLOCK_K):
        w = _dot_tile(w_ptr, offs_k, k, K, EVEN_K)
        w_up = _dot_tile(wu_ptr, offs_k, k, K, EVEN_K) if GATED else w
        acc, acc_up = _dot_step(acc, acc_up, _dot_tile(x_ptr, offs_k, k, K, EVEN_K), w, w_up,
                                GATED, PREC)
    _epilogue(acc, acc_up, Bias, Y, P, offs_m, offs_n, M, N, stride_ym, pid_k,
              HAS_BIAS, GATED, SPLIT, COMPILED)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    P, Bias, Y, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, COMPILED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Sums the [SPLIT, M, N(·2)] fp32 partials in split order (deterministic); the epilogue."""
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    width = 2 * N if GATED else N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        p = P + (s * M + m) * width + offs
        acc += tl.load(p, mask=mask, other=0.0)
        if GATED:
            acc_up += tl.load(p + N, mask=mask, other=0.0)
    dt = Y.dtype.element_ty
    if GATED:
        out = _silu_mul(_round(acc, dt, COMPILED), _round(acc_up, dt, COMPILED), dt, COMPILED)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + offs, mask=mask, other=0.0).to(tl.float32)
        out = _round(acc, dt, COMPILED)
    tl.store(Y + m * stride_ym + offs, out, mask=mask)


_COMPILED = _is_compiled(_gemv_fma_kernel)  # False under TRITON_INTERPRET=1


# ---- entry points ------------------------------------------------------------------------------
def supports(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """True when skinny_linear(x, weight) (skinny_gate_up_silu when `gated`) can run these
    tensors and the tuned table does not say cuBLAS is faster for this shape."""
    ok = (x.is_cuda and weight.is_cuda and x.device == weight.device
          and x.dtype == weight.dtype
          and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
          and x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= BATCH_MAX_M
          and x.shape[1] == weight.shape[1] and x.shape[1] >= 1 and weight.shape[0] >= 1
          and x.stride(1) == 1 and weight.is_contiguous())
    if not ok:
        return False
    key = _table_key(x, weight, gated)
    if key not in _TUNED:  # the heuristic (never TMA) up to MAX_M rows
        return x.shape[0] <= MAX_M
    cfg = _runnable(_TUNED[key], key, x)
    if cfg is None:  # an entry saying cuBLAS
        return False
    return not (cfg.tma or cfg.gluon) or _tma_can_read(x, weight)


def is_tuned(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """The tuned table has a kernel config (not cuBLAS) for this GEMM's rows and shape."""
    return _TUNED.get(_table_key(x, weight, gated)) is not None


def _runnable(cfg: Optional[Config], key: tuple, x: torch.Tensor) -> Optional[Config]:
    """A table entry, or where it names the Gluon kernel and this GPU cannot run it (not
    Hopper, bf16, or no Gluon in this Triton) the entry it replaced (GLUON_FALLBACK)."""
    if cfg is None or not cfg.gluon or (x.dtype == torch.bfloat16 and _gluon_runs(x.device)):
        return cfg
    return GLUON_FALLBACK.get(key)


def _gluon_runs(device: torch.device) -> bool:
    return (_COMPILED and device.type == "cuda" and _has_gluon_hopper()
            and _is_hopper(device.index if device.index is not None
                           else torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _has_gluon_hopper() -> bool:
    try:
        from rollout.layers import gluon_gemm  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:  # wgmma is sm_90a's alone
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _table_key(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> tuple[int, int, int, bool]:
    """The GEMM's key in `_TUNED`: rows rounded up to a power of two, weight rows, K, gated."""
    return triton.next_power_of_2(x.shape[0]), weight.shape[0], x.shape[1], gated


def _tma_can_read(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GPU has TMA (compute capability 9.0 and up: the table's TMA entries were measured on
    an H200 and an older GPU takes cuBLAS instead) and the rows start at multiples of 16 bytes."""
    size = x.element_size()
    return (_has_tma(x.device.index if x.device.index is not None else torch.cuda.current_device())
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and (x.stride(0) * size) % 16 == 0 and (x.shape[1] * size) % 16 == 0)


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]
            or x.dtype != weight.dtype or x.device != weight.device):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} must be [M, K] and [N, K] of one dtype and device")
    if not 1 <= x.shape[0] <= BATCH_MAX_M:
        raise ValueError(f"{x.shape[0]} rows: this kernel takes 1 to {BATCH_MAX_M}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x must be contiguous in its last dim and the weight contiguous")


def _launch(x, weight, bias, out, gated: bool, config: Optional[Config],
            defer_split: bool = False) -> Union[torch.Tensor, SplitSum]:
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]  # output columns
    # a Gluon entry this GPU cannot run whose fallback is cuBLAS: supports() says no, but a
    # direct call gets the heuristic's tiles
    cfg = config or _runnable(_config(M, weight.shape[0], K, gated),
                              _table_key(x, weight, gated), x) or BATCH_HEURISTIC
    if cfg.gluon:
        from rollout.layers import gluon_gemm
        return gluon_gemm.launch(x, weight, out, gated, cfg, defer_split, bias)
    if cfg.tma:
        from rollout.layers import triton_gemm_tma  # imports this module
        return triton_gemm_tma.launch(x, weight, bias, out, gated, cfg, defer_split)
    split, k_split = split_k_range(K, cfg)
    partials = split_partials(M, N, gated, split, out)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    w_up = weight[N:] if gated else weight  # the up half's rows
    args = (x, weight, w_up, bias_arg, out, partials, M, N, K, k_split, x.stride(0),
            out.stride(0))
    dot_preload = min(cfg.dot_preload, k_split // cfg.block_k) if cfg.dot else 0
    meta = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split,
                EVEN_K=k_split * split == K, HAS_BIAS=has_bias, GATED=gated, COMPILED=_COMPILED,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
                **launch_options(preloads_weights=not cfg.dot or dot_preload > 0))
    if cfg.dot:
        if not 0 <= cfg.dot_preload <= 3:
            raise ValueError(f"dot_preload={cfg.dot_preload}: the dot kernel loads 0 to 3 K "
                             "chunks early")
        grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
        _gemv_dot_kernel[grid](*args, BLOCK_M=cfg.block_m, PRELOAD=dot_preload, **meta,
                               PREC="ieee" if x.dtype == torch.float32 else "tf32")
    else:
        if M > FMA_MAX_M:
            raise ValueError(f"{M} rows: the FMA kernel takes at most {FMA_MAX_M} (use dot=True)")
        if not 1 <= cfg.preload <= 3:
            raise ValueError(f"preload={cfg.preload}: the FMA kernel loads 1 to 3 K chunks early")
        if cfg.pipeline > 1 and cfg.lookahead:
            raise ValueError("the FMA kernel's loop takes lookahead or pipeline, not both")
        preload = max(1, min(cfg.preload, k_split // cfg.block_k))  # no more than a split has
        _gemv_fma_kernel[(triton.cdiv(N, cfg.block_n), split)](
            *args, BLOCK_M=triton.next_power_of_2(M), PRELOAD=preload,
            LOOKAHEAD=bool(cfg.lookahead), PIPELINE=cfg.pipeline, **meta)
    return finish_split(partials, bias, out, gated, split, defer_split)


def finish_split(partials: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                 gated: bool, split: int, defer: bool) -> Union[torch.Tensor, SplitSum]:
    """After a launch: `out` (the partials summed into it when split along K), or with `defer`
    the partials themselves (and the bias) for the next kernel to sum (not the gated output,
    whose SiLU needs the sums)."""
    if split == 1:
        return out
    if defer and not gated:
        return SplitSum(partials, out, bias)
    reduce_split(partials, bias, out, gated, split)
    return out


def split_partials(M: int, N: int, gated: bool, split: int, out: torch.Tensor) -> torch.Tensor:
    """The fp32 partials [split, M, N (·2 gated)] a split-K launch writes (else `out`, unused)."""
    if split == 1:
        return out
    return torch.empty(split, M, 2 * N if gated else N, dtype=torch.float32, device=out.device)


def reduce_split(partials: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                 gated: bool, split: int) -> None:
    """out = the sum of the partials in split order (+ bias, or silu(gate) · up when gated)."""
    M, N = out.shape
    block = min(1024, triton.next_power_of_2(N))
    _split_k_reduce_kernel[(M, triton.cdiv(N, block))](
        partials, bias if bias is not None else out, out, M, N, out.stride(0), SPLIT=split,
        BLOCK=block, HAS_BIAS=bias is not None, GATED=gated, COMPILED=_COMPILED,
        num_warps=min(8, max(1, block // 256)), enable_fp_fusion=False, **launch_options())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  config: Optional[Config] = None,
                  defer_split: bool = False) -> Union[torch.Tensor, SplitSum]:
    """F.linear(x, weight, bias) for x [M, K] (1 <= M <= BATCH_MAX_M, rows contiguous), weight [N, K]
    contiguous, bias [N] or None; fp32 accumulation, output [M, N] in x's dtype rounded once.
    `config` overrides the launch config (benchmarks and tests). `defer_split`: when the config
    splits K, return the fp32 partials (and the bias) as a SplitSum instead of summing them
    here, for a reader that sums them itself (triton_ops.split_add_rms_norm, the rotary
    kernel's `source`)."""
    _check(x, weight)
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, weight, bias, out, False, config, defer_split)


def skinny_gate_up_silu(x: torch.Tensor, weight_gate_up: torch.Tensor, inter: int,
                        config: Optional[Config] = None) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight_gate_up)) without writing the [M, 2·inter] intermediate:
    weight [2·inter, K] with gate rows [0, inter) and up rows [inter, 2·inter); returns
    silu(gate) · up [M, inter], rounded as the unfused path (gate and up rounded to the dtype).
    Up to BATCH_MAX_M rows (the dot kernel tiles M above 16)."""
    _check(x, weight_gate_up)
    if weight_gate_up.shape[0] != 2 * inter or inter < 1:
        raise ValueError(f"weight {tuple(weight_gate_up.shape)} is not [2·{inter}, K]")
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    return _launch(x, weight_gate_up, None, out, True, config)


__all__ = ["skinny_linear", "skinny_gate_up_silu", "supports", "is_tuned", "Config", "MAX_M",
           "BATCH_MAX_M"]
