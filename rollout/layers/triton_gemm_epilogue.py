"""The epilogue shared by the decode GEMM kernels (triton_gemv, triton_stream_k): fp32 sums to
the rounded output (+ bias), or silu(gate) · up for the fused gate/up projection, rounded as the
unfused path rounds (gate and up each to the dtype, as a GEMM output, then
`silu(gate).to(dtype) * up` as triton_ops.silu_and_mul: libdevice expf, IEEE division)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from rollout.layers.triton_ops import _round


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
