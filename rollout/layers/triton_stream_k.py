"""Stream-K decode GEMMs: y = x @ W.T (or the fused gate/up + SiLU) for decode batches of
17..BATCH_MAX_M rows, with exactly one program per SM and every SM given the same number of
K iterations.

Why: at batch 128 the fused gate/up GEMM's 280 tiles make 2.1 waves on an H200's 132 SMs, and
cuBLAS's down/qkv/o run at 2-5x their bandwidth floor (latency, split-K). Stream-K (Osama et al.,
2023) lays all (tile, K chunk) iterations end to end and cuts the line into one equal range a
program: no wave tail, and a small GEMM still gets every SM.

A tile cut between programs is finished by the program that owns its last K chunk (its
"finisher"); the programs before it write their fp32 partial sums to a workspace slot (one a
program: only a program's last tile can be unfinished) and raise a flag; the finisher adds the
partials in program order, then its own sum, and runs the epilogue (bias, or SiLU · up, rounding
as triton_gemv). Fixed order: the same sums bit for bit on every call. Each program walks its
tiles from last to first, so it writes its partial first and waits for its predecessors' last:
on the GPU nobody waits long, and under the interpreter (programs run one by one in pid order)
every flag a finisher waits for is already raised. Waiting is safe because all programs are
resident at once (one a SM); under PDL the next kernel's blocks cannot start before all of ours
have passed `pdl_wait`. The finisher lowers the flags it consumed, so the workspace needs no
reset between calls (it starts zeroed).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from rollout.layers.triton_gemm_epilogue import _epilogue
from rollout.layers.triton_ops import _is_compiled
from rollout.triton_pdl import launch_options, pdl_wait


class StreamKConfig(NamedTuple):
    block_m: int = 128  # rows a tile (M above it: more tiles, M blocks innermost)
    block_n: int = 64  # weight rows a tile (per half, for the gated variant)
    block_k: int = 64  # K chunk an iteration
    num_warps: int = 8
    num_stages: int = 3
    programs: int = 0  # 0: one a streaming multiprocessor (tests set a small count)


@triton.jit
def _acc_tile(x_ptr, w_ptr, wu_ptr, offs_k, k_lo, k_hi, K, acc, acc_up, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr):
    for it in range(k_lo, k_hi):
        k = it * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptr + k)
            w = tl.load(w_ptr + k)
            if GATED:
                w_up = tl.load(wu_ptr + k)
        else:
            k_ok = (offs_k + k < K)[None, :]
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            w = tl.load(w_ptr + k, mask=k_ok, other=0.0)
            if GATED:
                w_up = tl.load(wu_ptr + k, mask=k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        if GATED:
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=PREC)
    return acc, acc_up


@triton.jit
def _first_program(i, TOTAL, P):
    """The program whose range [q·TOTAL // P, (q+1)·TOTAL // P) holds iteration i."""
    return ((i + 1) * P + TOTAL - 1) // TOTAL - 1


@triton.jit(do_not_specialize=["M"])
def _stream_k_kernel(
    X, W, W_UP, Bias, Y, Partials, Flags, M, N, K, stride_xm, stride_ym, ITERS, TOTAL,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLOT: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, COMPILED: tl.constexpr,
    PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    start = pid * TOTAL // P
    end = (pid + 1) * TOTAL // P
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    blocks_m = tl.cdiv(M, BLOCK_M)
    first_tile, last_tile = start // ITERS, (end - 1) // ITERS
    offs_bm, offs_bn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    slot = offs_bm[:, None] * BLOCK_N + offs_bn[None, :]  # gated: the up half at + BLOCK_M·BLOCK_N
    for j in range(0, last_tile - first_tile + 1):
        tile = last_tile - j  # last first: the partial (if any) goes out before anything else
        tile_start = tile * ITERS
        k_lo = tl.maximum(start, tile_start) - tile_start
        k_hi = tl.minimum(end, tile_start + ITERS) - tile_start
        offs_m = (tile % blocks_m) * BLOCK_M + offs_bm
        offs_n = (tile // blocks_m) * BLOCK_N + offs_bn
        rows_m = tl.minimum(offs_m, M - 1)  # clamped tail rows re-read a real row, never stored
        rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
        x_ptr = X + rows_m[:, None] * stride_xm + offs_k[None, :]
        w_ptr = W + rows_n[:, None] * K + offs_k[None, :]
        wu_ptr = W_UP + rows_n[:, None] * K + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc, acc_up = _acc_tile(x_ptr, w_ptr, wu_ptr, offs_k, k_lo, k_hi, K, acc, acc_up,
                                BLOCK_K, EVEN_K, GATED, PREC)
        if k_hi < ITERS:  # not this tile's finisher: hand the partial over
            own = Partials + pid * SLOT + slot
            tl.store(own, acc)
            if GATED:
                tl.store(own + BLOCK_M * BLOCK_N, acc_up)
            tl.debug_barrier()  # every thread's partial stored before the flag goes up
            tl.atomic_xchg(Flags + pid, 1, sem="release", scope="gpu")
        else:
            if k_lo > 0:  # the partials of the programs before, in program order, then ours
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                part_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for q in range(_first_program(tile_start, TOTAL, P), pid):
                    while tl.atomic_add(Flags + q, 0, sem="acquire", scope="gpu") == 0:
                        pass
                    tl.debug_barrier()
                    theirs = Partials + q * SLOT + slot
                    part += tl.load(theirs, cache_modifier=".cg")
                    if GATED:
                        part_up += tl.load(theirs + BLOCK_M * BLOCK_N, cache_modifier=".cg")
                    tl.atomic_xchg(Flags + q, 0, sem="relaxed", scope="gpu")
                acc = part + acc
                acc_up = part_up + acc_up
            _epilogue(acc, acc_up, Bias, Y, Partials, offs_m, offs_n, M, N, stride_ym, 0,
                      HAS_BIAS, GATED, 1, COMPILED)


_COMPILED = _is_compiled(_stream_k_kernel)
_workspaces: dict = {}  # (device type, index) -> the largest (partials, flags) so far
_outgrown: list = []  # smaller ones, kept alive: captured CUDA graphs may still point at them


def _workspace(device: torch.device, programs: int, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, flags) for `programs` programs of `floats` fp32 each, per device, grown when a
    call needs more. Flags start at zero and every call leaves them at zero. Allocated outside
    CUDA graph captures (the warm-up forward before a capture runs every shape first)."""
    key = (device.type, device.index)
    have = _workspaces.get(key)
    if have is None or have[0].numel() < programs * floats or have[1].numel() < programs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("stream-K workspace first needed inside a CUDA graph capture: "
                               "run the shape once eagerly before capturing")
        if have is not None:
            _outgrown.append(have)
            programs = max(programs, have[1].numel())
            floats = max(floats, have[0].numel() // have[1].numel())
        have = (torch.empty(programs * floats, dtype=torch.float32, device=device),
                torch.zeros(programs, dtype=torch.int32, device=device))
        _workspaces[key] = have
    return have


def num_programs(device: torch.device, cfg: StreamKConfig, total_iters: int) -> int:
    if cfg.programs > 0:
        count = cfg.programs
    elif device.type == "cuda":
        count = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        count = 4
    return max(1, min(count, total_iters))


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
           gated: bool, cfg: StreamKConfig) -> torch.Tensor:
    """out = x @ weight.T (+ bias), or silu(gate) · up for the fused [gate | up] weight (gated);
    shapes checked by the caller (triton_gemv)."""
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    iters = triton.cdiv(K, cfg.block_k)
    total = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n) * iters
    programs = num_programs(x.device, cfg, total)
    slot = (2 if gated else 1) * cfg.block_m * cfg.block_n  # fp32 partial sums a program
    partials, flags = _workspace(x.device, programs, slot)
    _stream_k_kernel[(programs,)](
        x, weight, weight[N:] if gated else weight, bias if bias is not None else out, out,
        partials, flags, M, N, K, x.stride(0), out.stride(0), iters, total,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SLOT=slot,
        EVEN_K=K % cfg.block_k == 0, HAS_BIAS=bias is not None, GATED=gated,
        COMPILED=_COMPILED, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **launch_options())
    return out


__all__ = ["StreamKConfig", "launch", "num_programs"]
