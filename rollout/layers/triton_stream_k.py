"""Stream-K decode GEMM fed by TMA: y = x @ W.T (or the fused gate/up + SiLU) for decode batches,
every program given the same number of (tile, K chunk) iterations, for triton_gemv's table
entries with `Config.stream_k` (programs per SM).

Why: at 128 rows the fused gate/up's 280 tiles fall three to an SM on 16 SMs and two on the
other 116, and under Nsight Compute its SMs are active only 77% of its cycles: the SMs with a
third tile set its time (docs/BENCHMARKS.md, twelfth session). Stream-K (Osama et al., 2023)
lays all iterations end to end and cuts the line into equal ranges, one a program, so every SM
gets the same work. The ninth session's stream-K ran one program an SM with pointer loads (too
few bytes in flight: 25.9 µs vs 22.0); this one loads its tiles by TMA and runs two or three
programs an SM.

A tile cut between programs is finished by the program that owns its last K chunk (its
"finisher"); the programs before it write their fp32 partial sums to a workspace slot (one a
program: only a program's last tile can be unfinished) and raise a flag; the finisher adds the
partials to its own sum in program order and runs triton_gemv's epilogue (bias, or SiLU · up,
rounded as the unfused path). Fixed order: the same bits on every call. Each program walks its
tiles from last to first, so it writes its partial first and waits for its predecessors' last;
under the interpreter (programs run one by one in pid order) every flag a finisher waits for is
already raised. Waiting needs the predecessor resident: the launch asks for no more programs
than fit on the GPU at once (`programs` a SM, checked against the config's shared memory by the
caller's table), and lower program ids are placed first. The finisher lowers the flags it
consumed, so the workspace needs no reset between calls (it starts zeroed).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rollout.layers.triton_gemv import Config, _epilogue
from rollout.layers.triton_ops import _is_compiled
from rollout.triton_pdl import launch_options, pdl_wait

CPU_SMS = 4  # programs a "SM" stands for under the interpreter (tests pass their own count)


@triton.jit
def _acc_tile(x_desc, w_desc, off_m, off_n, N, k_lo, k_hi, acc, acc_up, BLOCK_K: tl.constexpr,
              SWAP_AB: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr):
    """acc (+ acc_up) += the tile's products over K chunks [k_lo, k_hi)."""
    for it in range(k_lo, k_hi):
        k = it * BLOCK_K
        x = x_desc.load([off_m, k])
        w = w_desc.load([off_n, k])
        if SWAP_AB:
            acc = tl.dot(w, x.T, acc, input_precision=PREC)
        else:
            acc = tl.dot(x, w.T, acc, input_precision=PREC)
        if GATED:  # the up half's rows start at N
            w_up = w_desc.load([N + off_n, k])
            if SWAP_AB:
                acc_up = tl.dot(w_up, x.T, acc_up, input_precision=PREC)
            else:
                acc_up = tl.dot(x, w_up.T, acc_up, input_precision=PREC)
    return acc, acc_up


@triton.jit
def _first_program(i, TOTAL, P):
    """The program whose range [q·TOTAL // P, (q+1)·TOTAL // P) holds iteration i."""
    return ((i + 1) * P + TOTAL - 1) // TOTAL - 1


@triton.jit(do_not_specialize=["M"])
def _stream_k_kernel(
    x_desc, w_desc, Bias, Y, Partials, Flags, M, N, stride_ym, ITERS, TOTAL,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLOT: tl.constexpr,
    SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    COMPILED: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    start = pid * TOTAL // P
    end = (pid + 1) * TOTAL // P
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    blocks_m = tl.cdiv(M, BLOCK_M)
    first_tile, last_tile = start // ITERS, (end - 1) // ITERS
    # the accumulator's shape: [BLOCK_N, BLOCK_M] when swapped (out^T = W x^T)
    ROWS: tl.constexpr = BLOCK_N if SWAP_AB else BLOCK_M
    COLS: tl.constexpr = BLOCK_M if SWAP_AB else BLOCK_N
    slot = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]  # up half: + R·C
    for j in range(0, last_tile - first_tile + 1):
        tile = last_tile - j  # last first: the partial (if any) goes out before anything else
        tile_start = tile * ITERS
        k_lo = tl.maximum(start, tile_start) - tile_start
        k_hi = tl.minimum(end, tile_start + ITERS) - tile_start
        off_m = (tile % blocks_m) * BLOCK_M  # M blocks innermost, as the TMA kernel
        off_n = (tile // blocks_m) * BLOCK_N
        acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
        acc_up = tl.zeros([ROWS, COLS], dtype=tl.float32)
        acc, acc_up = _acc_tile(x_desc, w_desc, off_m, off_n, N, k_lo, k_hi, acc, acc_up,
                                BLOCK_K, SWAP_AB, GATED, PREC)
        if k_hi < ITERS:  # not this tile's finisher: hand the partial over
            own = Partials + pid * SLOT + slot
            tl.store(own, acc)
            if GATED:
                tl.store(own + ROWS * COLS, acc_up)
            tl.debug_barrier()  # every thread's partial stored before the flag goes up
            tl.atomic_xchg(Flags + pid, 1, sem="release", scope="gpu")
        else:
            if k_lo > 0:  # ours, then the partials of the programs before in program order
                # (added into acc: no second pair of accumulators, whose registers cost a program
                # an SM)
                for q in range(_first_program(tile_start, TOTAL, P), pid):
                    while tl.atomic_add(Flags + q, 0, sem="acquire", scope="gpu") == 0:
                        pass
                    tl.debug_barrier()
                    theirs = Partials + q * SLOT + slot
                    acc += tl.load(theirs, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(theirs + ROWS * COLS, cache_modifier=".cg")
                    tl.atomic_xchg(Flags + q, 0, sem="relaxed", scope="gpu")
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            if SWAP_AB:  # transposed in the call: a branch may not change acc's shape
                _epilogue(acc.T, acc_up.T, Bias, Y, Partials, offs_m, offs_n, M, N, stride_ym, 0,
                          HAS_BIAS, GATED, 1, COMPILED)
            else:
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


def num_programs(device: torch.device, per_sm: int, total_iters: int) -> int:
    """`per_sm` programs on each SM (never more than there are iterations)."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else CPU_SMS)
    return max(1, min(per_sm * sms, total_iters))


def launch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
           gated: bool, cfg: Config, programs: Optional[int] = None) -> torch.Tensor:
    """out = x @ weight.T (+ bias), or silu(gate) · up of the fused [gate | up] weight (gated);
    shapes checked by triton_gemv, 16-byte aligned rows (TMA). `programs` overrides
    `cfg.stream_k` programs a SM (tests)."""
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    size = x.element_size()
    if (x.stride(0) * size) % 16 or (K * size) % 16 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        raise ValueError(f"TMA needs 16-byte aligned rows: x stride {x.stride(0)}, K {K}")
    iters = triton.cdiv(K, cfg.block_k)
    total = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n) * iters
    programs = min(programs, total) if programs else num_programs(x.device, cfg.stream_k, total)
    slot = (2 if gated else 1) * cfg.block_m * cfg.block_n  # fp32 partial sums a program
    partials, flags = _workspace(x.device, programs, slot)
    x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    _stream_k_kernel[(programs,)](
        x_desc, w_desc, bias if bias is not None else out, out, partials, flags, M, N,
        out.stride(0), iters, total, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SLOT=slot, SWAP_AB=bool(cfg.swap_ab), HAS_BIAS=bias is not None,
        GATED=gated, COMPILED=_COMPILED, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **launch_options())
    return out


__all__ = ["launch", "num_programs"]
