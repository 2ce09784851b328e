"""A prefill chunk's gate/up + SiLU: the engine's path (cuBLAS GEMM, then the SiLU·mul kernel)
beside the Gluon GEMM with the SiLU in its epilogue (rollout/layers/gluon_gemm.py, the decode
batches' kernel, here at thousands of rows), in one process.

Why: in batch 128's call the SiLU·mul kernel takes ~6 ms of the ≈80 ms prefill (it reads the
[tokens, 2·inter] GEMM output and writes half of it, at the copy bandwidth); a GEMM that writes
silu(gate)·up itself saves that kernel if its own speed stays near cuBLAS's.

Qwen2-1.5B's gate/up (17,920 x 1,536), bf16, x random; µs a call in a CUDA graph of back-to-back
calls (benchmarks/gpu_gemv.py's timing), TFLOP/s on the GEMM's 2·M·N·K. Every Gluon result is
checked against cuBLAS + silu_and_mul first (relative error and the share of equal elements).

  python benchmarks/gpu_prefill_gate_up.py --rows 4096 8192 --out $OUT/prefill_gate_up.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.gpu_gemv import copy_bandwidth, rel_err, run_info, time_per_call

INTER, HIDDEN = 8960, 1536


def configs():
    """(block_n, stages) of the Gluon kernel: 128-row x tiles, two consumer warpgroups."""
    from rollout.layers.gemv_launch import Config
    for block_n, stages in ((128, 4), (128, 3), (64, 4), (64, 6), (136, 4)):
        yield Config(block_n, 64, 1, 8, True, stages, 128, preload=0, gluon=True)


def run_rows(M: int, gen: torch.Generator) -> dict:
    from rollout.layers import gluon_gemm, triton_ops
    x = torch.randn(M, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2 * INTER, HIDDEN, generator=gen, device="cuda") * HIDDEN ** -0.5).to(
        torch.bfloat16)
    flop = 2 * M * 2 * INTER * HIDDEN
    ref = triton_ops.silu_and_mul(F.linear(x, w))
    out = torch.empty(M, INTER, dtype=torch.bfloat16, device="cuda")
    rows = {"rows": M}
    t = time_per_call(lambda i: F.linear(x, w), 1)
    rows["cublas_gemm_us"] = t * 1e6
    t = time_per_call(lambda i: triton_ops.silu_and_mul(F.linear(x, w)), 1)
    rows["cublas_plus_silu_us"] = t * 1e6
    rows["cublas_tflops"] = flop / rows["cublas_gemm_us"] / 1e6
    rows["gluon"] = []
    for cfg in configs():
        entry = {"block_n": cfg.block_n, "stages": cfg.num_stages}
        try:
            out.fill_(float("nan"))
            gluon_gemm.launch(x, w, out, True, cfg)
            torch.cuda.synchronize()
            entry["rel_err"] = rel_err(out, ref)
            entry["equal_share"] = (out == ref).float().mean().item()
            if entry["rel_err"] <= 1e-2:
                t = time_per_call(lambda i: gluon_gemm.launch(x, w, out, True, cfg), 1)
                entry["us"] = t * 1e6
                entry["tflops"] = flop / entry["us"] / 1e6
        except Exception as e:  # noqa: BLE001 - a config the kernel refuses or cannot fit
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(M, entry, flush=True)
        rows["gluon"].append(entry)
    print(M, {k: v for k, v in rows.items() if k != "gluon"}, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"run_info": run_info(copy_bandwidth()), "cases": []}
    for M in args.rows:
        result["cases"].append(run_rows(M, gen))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
