"""Decode-batch GEMMs on one GPU, side by side: cuBLAS (+ the SiLU kernel for gate/up), the
table's current path (triton_gemv's entry for the shape and rows, else cuBLAS) and the TMA-fed
tensor-core kernel (rollout/layers/triton_gemm_tma.py) over a sweep of tile configs, Qwen2-1.5B
shapes in bf16 at 32-256 rows.

Times as benchmarks/gpu_gemv.py (a CUDA graph of back-to-back calls rotating weight copies
larger than L2, so each call reads its weight from HBM). Each config is also checked: relative
error against cuBLAS and the same bits on a second call. Writes the JSON and a configs file
(`--configs-out`, for ROLLOUT_SKINNY_CONFIGS / benchmarks/engine_ab.py) with the best TMA config
of every case where it beats the current path.

  python benchmarks/gpu_gemm_tma.py --out $OUT/tma.json --configs-out $OUT/tma_configs.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.gpu_gemv import CALLS, ROTATE_BYTES, SHAPES, copy_bandwidth, rel_err, time_per_call


def candidates(M: int) -> list[dict]:
    """TMA tile configs, the likeliest first (the sweep may be cut by the budget)."""
    bm = min(128, max(64, 1 << (M - 1).bit_length()))
    block_ms = [bm, 64] if bm == 128 else [bm]
    # the ninth session's winners first (64 x 32 tiles, K chunks of 128 with 6 stages, or of 64
    # with 4), then the first sweep's order
    first = [(64, 32, 128, 4, 6), (64, 32, 64, 4, 4)] + [(bm, 64, 64, 4, s) for s in (4, 6, 3)] + [
        (64, 64, 64, 4, 5), (bm, 128, 64, 8, 4), (bm, 64, 128, 4, 3), (bm, 32, 64, 4, 6)]
    rest = [(m, n, k, w, s) for m in block_ms for n in (32, 64, 128)
            for k in (64, 128) for w in (4, 8) for s in (3, 4, 5, 6)]
    seen, out = set(), []
    for c in first + rest:
        if c not in seen:
            seen.add(c)
            out.append(dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), c)))
    return out


def run_case(name: str, M: int, copy_bw: float, budget_s: float) -> dict:
    from rollout.layers import triton_gemv as g, triton_ops
    N, K, has_bias, gated = SHAPES[name]
    wbytes = N * K * 2
    n_w = max(1, min(CALLS, math.ceil(ROTATE_BYTES / wbytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K ** -0.5
          for _ in range(n_w)]
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen) if has_bias else None
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run(cfg):  # cfg: None = cuBLAS, "table" = the current path, else a TMA config dict
        if isinstance(cfg, dict):
            c = g.Config(cfg["block_n"], cfg["block_k"], 1, cfg["num_warps"], True,
                         cfg["num_stages"], cfg["block_m"], tma=True)
            if gated:
                return lambda i: g.skinny_gate_up_silu(x, ws[i], N // 2, config=c)
            return lambda i: g.skinny_linear(x, ws[i], bias, config=c)
        if gated:
            if cfg is None:
                return lambda i: triton_ops.silu_and_mul(F.linear(x, ws[i]))
            return lambda i: g.skinny_gate_up_silu(x, ws[i], N // 2)
        if cfg is None:
            return lambda i: F.linear(x, ws[i], bias)
        return lambda i: g.skinny_linear(x, ws[i], bias)

    def stats(seconds: float) -> dict:
        gbps = wbytes / seconds / 1e9
        return {"us": seconds * 1e6, "GBps": gbps, "frac_copy": gbps * 1e9 / copy_bw}

    ref = run(None)(0)
    row = {"name": name, "M": M, "N": N, "K": K, "gated": gated, "weight_bytes": wbytes,
           "cublas": stats(time_per_call(run(None), n_w))}
    table = g.supports(x, ws[0], gated)
    row["table"] = stats(time_per_call(run("table"), n_w)) if table else dict(row["cublas"])
    row["table"]["kernel"] = "triton_gemv" if table else "cublas"
    deadline, tried = time.perf_counter() + budget_s, []
    for c in candidates(M):
        if time.perf_counter() > deadline:
            row["sweep_cut_by_budget"] = True
            break
        entry = {"config": c}
        try:
            fn = run(c)
            a, b = fn(0), fn(0)
            torch.cuda.synchronize()
            entry.update(rel_err=rel_err(a, ref), same_bits=bool(torch.equal(a, b)))
            entry.update(stats(time_per_call(fn, n_w)))
        except Exception as e:  # does not compile / fit: record and go on
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        tried.append(entry)
    row["tma"] = tried
    ok = [t for t in tried if "us" in t and t["rel_err"] <= 1e-2 and t["same_bits"]]
    if ok:
        row["best"] = min(ok, key=lambda t: t["us"])
        row["speedup_vs_cublas"] = row["cublas"]["us"] / row["best"]["us"]
        row["speedup_vs_table"] = row["table"]["us"] / row["best"]["us"]
    del ws
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--configs-out", default=None)
    p.add_argument("--shapes", nargs="*", default=["gate_up", "down", "qkv", "o"])
    p.add_argument("--rows", nargs="*", type=int, default=[128, 64, 32])
    p.add_argument("--case-budget-s", type=float, default=25.0)
    p.add_argument("--min-gain", type=float, default=1.02, help="configs file: faster by this")
    args = p.parse_args()
    result: dict = {"errors": [], "cases": []}
    copy_bw = copy_bandwidth()
    result.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, copy_bandwidth_GBps=copy_bw / 1e9)
    print(f"{'shape':8} {'M':>3} | {'cuBLAS':>7} | {'table':>7} | {'TMA':>8} "
          f"{'x cuBLAS':>8} {'x table':>7}  best config (m, n, k, warps, stages)")
    for M in args.rows:
        for name in args.shapes:
            try:
                row = run_case(name, M, copy_bw, args.case_budget_s)
            except Exception:
                result["errors"].append(f"{name} M={M}: {traceback.format_exc()}")
                print(f"{name:8} {M:3} | failed: {traceback.format_exc().splitlines()[-1]}")
                continue
            result["cases"].append(row)
            best = row.get("best")
            print(f"{name:8} {M:3} | {row['cublas']['us']:7.2f} | {row['table']['us']:7.2f} | "
                  + (f"{best['us']:8.2f} {row['speedup_vs_cublas']:8.2f} "
                     f"{row['speedup_vs_table']:7.2f}  {tuple(best['config'].values())}"
                     if best else "    none")
                  + f"  ({sum('error' in t for t in row['tma'])} failed)", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    if args.configs_out:
        entries = [{"M": r["M"], "N": r["N"], "K": r["K"], "gated": r["gated"],
                    "config": {"split_k": 1, "dot": True, "tma": True, **r["best"]["config"]}}
                   for r in result["cases"] if r.get("speedup_vs_table", 0) >= args.min_gain]
        with open(args.configs_out, "w") as f:
            json.dump(entries, f, indent=1)
        print(f"{len(entries)} TMA entries -> {args.configs_out}")


if __name__ == "__main__":
    main()
