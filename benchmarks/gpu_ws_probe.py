"""Does Triton's automatic warp specialization run the batch-128 gate/up GEMM right, and faster,
when its TMA descriptors are made on the device? A probe, not an engine kernel.

The twelfth session's try (host `TensorDescriptor`s, `tl.range(warp_specialize=True)`) gave NaN
outputs with Triton 3.6 on the H200. Triton issue #9719 reports NaNs from host descriptors on
3.6 where device-made ones (`tl.make_tensor_descriptor`) work. The forty-second session's
overlap probe found the table's loop with its MMAs alone at 13.6 µs and whole at 19.4 (the
weight-read floor 12.9): a loop whose loads a producer warp issues could hide more of one under
the other. Each variant runs in a child process with a time limit (a deadlocked kernel never
returns). A variant is the gate/up loop (x [128, 1,536] by Qwen2-1.5B's gate and up rows, two
MMAs a K chunk, out = gate + up sums, so it is checked against torch; or the gate rows alone,
one accumulator) with tiles, warps, stages, swapped A/B and warp specialization; µs a call in a CUDA graph rotating weight copies
larger than L2, as benchmarks/gpu_gemv.py.

  python benchmarks/gpu_ws_probe.py --out $OUT/ws_probe.json
"""
from __future__ import annotations

import json

import triton
import triton.language as tl

from benchmarks.child_variants import probe_main

M_ROWS, INTER, HIDDEN = 128, 8960, 1536


@triton.jit
def gate_up(X, W, Y, M, I, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            STAGES: tl.constexpr, SWAP: tl.constexpr, WS: tl.constexpr, PAIRED: tl.constexpr):
    x_desc = tl.make_tensor_descriptor(X, [M, K], [K, 1], [BM, BK])
    w_desc = tl.make_tensor_descriptor(W, [2 * I, K], [K, 1], [BN, BK])
    blocks_m = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    off_m = (pid % blocks_m) * BM
    off_n = (pid // blocks_m) * BN
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    for k in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=WS):
        x = x_desc.load([off_m, k])
        w = w_desc.load([off_n, k])
        if SWAP:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
        if PAIRED:  # the up rows' tile and MMA; else the gate rows alone (one accumulator)
            w_up = w_desc.load([I + off_n, k])
            if SWAP:
                acc_up = tl.dot(w_up, x.T, acc_up)
            else:
                acc_up = tl.dot(x, w_up.T, acc_up)
    out = acc + acc_up
    if SWAP:
        out = out.T
    offs_m = off_m + tl.arange(0, BM)
    offs_n = off_n + tl.arange(0, BN)
    tl.store(Y + offs_m[:, None] * I + offs_n[None, :], out.to(Y.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < I)[None, :])


def child(variant: list) -> None:
    """Run one variant in this process and print its JSON line."""
    import torch
    from benchmarks.gpu_gemv import time_per_call, weight_copies
    BM, BN, BK, WARPS, STAGES, SWAP, WS, PAIRED = variant
    M, I, K = M_ROWS, INTER, HIDDEN
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(2 * I, K, gen)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
    grid = (triton.cdiv(M, BM) * triton.cdiv(I, BN),)

    def call(i):
        gate_up[grid](x, ws[i], y, M, I, K, BM=BM, BN=BN, BK=BK, STAGES=STAGES, SWAP=SWAP, WS=WS,
                      PAIRED=PAIRED, num_warps=WARPS)

    call(0)
    torch.cuda.synchronize()
    ref = x.float() @ (ws[0][:I].float() + (ws[0][I:].float() if PAIRED else 0)).T
    err = ((y.float() - ref).norm() / ref.norm()).item()
    nan = int(y.isnan().sum())
    us = time_per_call(call, len(ws)) * 1e6 if err < 1e-2 and nan == 0 else None
    print(json.dumps({"rel_err": err, "nan": nan, "us": us, "programs": grid[0]}))


# (BM x rows, BN weight rows, BK, warps, stages, swapped, warp-specialized, gate and up paired)
VARIANTS = [
    (64, 64, 64, 4, 3, True, False, True),  # the table's tiles, device descriptors
    (64, 64, 64, 4, 3, True, True, True),
    (128, 64, 64, 4, 3, False, False, True),  # all rows a program, x on wgmma's M side (140)
    (128, 64, 64, 4, 3, False, True, True),
    (128, 64, 64, 8, 3, False, True, True),
    (128, 64, 64, 4, 4, False, True, True),
    (64, 64, 64, 4, 4, False, True, True),
    (128, 64, 64, 4, 3, True, True, True),  # swapped, 128 x rows on the N side (140)
    # one accumulator (the gate rows alone): does the warp-specialized loop compute right?
    (64, 64, 64, 4, 3, True, False, False),
    (64, 64, 64, 4, 3, True, True, False),
    (128, 64, 64, 4, 3, False, False, False),
    (128, 64, 64, 4, 3, False, True, False),
    (128, 128, 64, 4, 3, False, True, False),
]


def main() -> None:
    probe_main(__file__, __doc__.splitlines()[0], VARIANTS,
               lambda v: {"block_m_n_k": v[:3], "num_warps": v[3], "num_stages": v[4], "swap_ab": v[5],
                           "warp_specialize": v[6], "paired": v[7]},
               child, timeout_s=45)


if __name__ == "__main__":
    main()
