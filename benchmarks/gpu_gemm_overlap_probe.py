"""Does the batch-128 TMA GEMM's K loop overlap its loads with its MMAs? A probe, not an engine
kernel: the fused gate/up GEMM's loop as the table runs it at 128 rows, without its SiLU
epilogue (triton_gemm_tma's swapped 64 x 64 x 64 tiles, 280 programs, 3 stages; Qwen2-1.5B's
17,920 x 1,536 in bf16; its output is the gate and up sums added, checked against torch), in
three forms of one kernel:

  full   the loop as the engine's (TMA loads of x and the gate and up weight tiles, two MMAs);
  loads  the same loads, each tile reduced to one number instead of the MMAs (so the loads are
         kept), no MMA;
  mma    the tiles loaded once before the loop, then the same MMAs every iteration (no loads in
         the loop).

`mma` against the weight-read floor says whether the tensor cores alone, at these tiles, take
as long as reading the weights; `full` against both says how much of the two the loop overlaps.
`loads` turned out no bound (forty-second session: 57.9 µs against `full`'s 19.4 at 128 rows):
the reduction that keeps its tiles costs more than the MMAs it replaces. Times as
benchmarks/gpu_gemv.py (a CUDA graph of back-to-back calls rotating weight copies larger than
L2). Writes JSON.

  python benchmarks/gpu_gemm_overlap_probe.py --out $OUT/overlap.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.gpu_gemv import copy_bandwidth, run_info, time_per_call, weight_copies

HIDDEN, INTER = 1536, 8960


@triton.jit
def _probe_kernel(x_desc, w_desc, Y, M, N, K, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    blocks_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    off_m = (pid % blocks_m) * BLOCK_M
    off_n = (pid // blocks_m) * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if MODE == 2:  # mma: the tiles once, the MMAs every iteration
        x = x_desc.load([off_m, 0])
        w = w_desc.load([off_n, 0])
        w_up = w_desc.load([N + off_n, 0])
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(w, x.T, acc)
            acc_up = tl.dot(w_up, x.T, acc_up)
    else:
        for k in range(0, K, BLOCK_K):
            x = x_desc.load([off_m, k])
            w = w_desc.load([off_n, k])
            w_up = w_desc.load([N + off_n, k])
            if MODE == 0:  # full
                acc = tl.dot(w, x.T, acc)
                acc_up = tl.dot(w_up, x.T, acc_up)
            else:  # loads: keep them with a cheap use
                acc += (tl.sum(x.to(tl.float32), axis=1)[None, :]
                        + tl.sum(w.to(tl.float32) + w_up.to(tl.float32), axis=1)[:, None])
    out = (acc + acc_up).T
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    tl.store(Y + offs_m[:, None] * N + offs_n[None, :], out.to(Y.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


MODES = {"full": 0, "loads": 1, "mma": 2}


def run(M: int, block: tuple[int, int, int], warps: int, stages: int, copy_bw: float) -> dict:
    bm, bn, bk = block
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(2 * INTER, HIDDEN, gen)
    x = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.empty(M, INTER, device="cuda", dtype=torch.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
    grid = (triton.cdiv(M, bm) * triton.cdiv(INTER, bn),)
    row = {"M": M, "block_m_n_k": block, "num_warps": warps, "num_stages": stages,
           "programs": grid[0]}
    for name, mode in MODES.items():
        def call(i, mode=mode):
            _probe_kernel[grid](x_desc, w_descs[i], y, M, INTER, HIDDEN, MODE=mode,
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                num_stages=stages)
        us = time_per_call(call, len(ws)) * 1e6
        row[name] = {"us": us, "weight_frac_copy": ws[0].numel() * 2 / (us * 1e-6) / copy_bw}
    # the full form computes the GEMM (the gate and up sums added): check it
    w = ws[0]
    _probe_kernel[grid](x_desc, w_descs[0], y, M, INTER, HIDDEN, MODE=0, BLOCK_M=bm,
                        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    ref = x.float() @ (w[:INTER].float() + w[INTER:].float()).T
    row["full_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
    ws.clear()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    copy_bw = copy_bandwidth()
    result = {**run_info(copy_bw), "rows": []}
    cases = [(128, (64, 64, 64), 4, 3), (64, (64, 64, 64), 4, 3), (128, (128, 64, 64), 4, 3),
             (128, (64, 64, 128), 4, 3), (128, (64, 128, 64), 8, 3)]
    print(f"{'M':>4} {'tiles':>14} {'progs':>5} | {'full':>7} {'loads':>7} {'mma':>7} | "
          "loads+mma  max")
    for M, block, warps, stages in cases:
        try:
            row = run(M, block, warps, stages, copy_bw)
        except Exception as e:  # a form that does not compile: record it, go on
            result["rows"].append({"M": M, "block_m_n_k": block, "error": f"{type(e).__name__}: "
                                                                          f"{str(e)[:300]}"})
            print(f"{M:4} {str(block):>14} failed: {type(e).__name__}", flush=True)
            continue
        result["rows"].append(row)
        f, lo, mm = row["full"]["us"], row["loads"]["us"], row["mma"]["us"]
        print(f"{M:4} {str(block):>14} {row['programs']:5} | {f:7.2f} {lo:7.2f} {mm:7.2f} | "
              f"{lo + mm:9.2f} {max(lo, mm):5.2f}  (rel err {row['full_rel_err']:.1e})",
              flush=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
