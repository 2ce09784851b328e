"""A projection read by a residual add + RMSNorm (down, or o), then that add + norm, on one GPU,
side by side: cuBLAS then the add + norm kernel, the table's current path (triton_gemv's entry,
with the split-K reduce kernel where it splits), and the projection split along K with its
partials summed by the add + norm kernel itself (`defer_split`, triton_ops.split_add_rms_norm)
over a sweep of split configs: FMA configs at one row, TMA tiles at decode batches. Qwen2-1.5B
shapes, bf16.

Times as benchmarks/gpu_gemv.py: a CUDA graph of back-to-back (GEMM, add + norm) pairs rotating
weight copies larger than L2, so each GEMM reads its weight from HBM; under PDL the pairs chain
as in the engine. Every deferred config is checked: the same bits as the reduce + norm path with
the same config. Writes the JSON and a configs file (`--configs-out`, for
benchmarks/engine_ab.py) with the best deferred config per row count where it beats the table's
path by `--min-gain`.

  python benchmarks/gpu_split_norm.py --shape down --rows 1 32 64 128 \
      --out $OUT/split_norm.json --configs-out $OUT/split_norm_configs.json
"""
from __future__ import annotations

import json
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.gpu_gemm_tma import candidates as tma_candidates
from benchmarks.gpu_gemv import (start_sweep, sweep_parser, time_per_call, weight_copies,
                                 write_winners)

SHAPES = {"down": (1536, 8960), "o": (1536, 1536)}  # N, K
EPS = 1e-6


def split_configs(g, shape: str, M: int) -> list:
    """Configs that split the projection's K (the likeliest first)."""
    out = []
    if M == 1 and shape == "down":  # the FMA config (2 rows a program, lookahead) split along K
        for s in (2, 4, 5, 7, 3):
            for bn, bk, nw in ((2, 1024, 8), (2, 512, 8), (2, 256, 8), (4, 256, 8), (2, 512, 4),
                               (2, 256, 4)):
                out.append(g.Config(bn, bk, s, nw, False, 3, preload=2, lookahead=True))
    elif M == 1:  # o, K = 1,536: the table's (whole row block loaded before the wait) split
        for s, bk, pre in ((2, 256, 3), (3, 256, 2), (2, 512, 2), (3, 512, 1), (6, 256, 1)):
            for bn, nw in ((2, 2), (2, 4), (4, 4), (1, 2)):
                out.append(g.Config(bn, bk, s, nw, False, 3, preload=pre))
    elif shape == "down":
        out = [g.Config(c["block_n"], c["block_k"], c["split_k"], c["num_warps"], True,
                        c["num_stages"], c["block_m"], tma=True, swap_ab=c["swap_ab"])
               for c in tma_candidates(M, "down") if c["split_k"] > 1]
    else:  # o at decode batches: the table's 64 x 32 tiles (96 programs at 64 rows) split
        bm = 128 if M >= 128 else 64
        for s in (2, 3, 4, 6):
            for bn, bk, st in ((32, 128, 6), (32, 64, 6), (64, 128, 4), (32, 256, 3)):
                if 1536 // bk >= s:
                    out.append(g.Config(bn, bk, s, 4, True, st, 64, tma=True))
            out.append(g.Config(64, 128, s, 4, True, 4, bm, tma=True, swap_ab=True))
    return out


def run_case(shape: str, M: int, copy_bw: float, budget_s: float) -> dict:
    from rollout.layers import triton_gemv as g, triton_ops
    N, K = SHAPES[shape]
    wbytes = N * K * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(N, K, gen)
    n_w = len(ws)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    nw = torch.rand(N, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5

    def reduced(down):  # down's output (a tensor), then the add + norm
        return lambda i: triton_ops.fused_add_rms_norm(down(i), res, nw, EPS)

    def deferred(cfg):
        return lambda i: triton_ops.split_add_rms_norm(
            g.skinny_linear(x, ws[i], config=cfg, defer_split=True), res, nw, EPS)

    def stats(seconds: float) -> dict:
        return {"us": seconds * 1e6, "weight_frac_copy": wbytes / seconds / copy_bw}

    table = g.supports(x, ws[0])
    row = {"shape": shape, "M": M, "N": N, "K": K, "weight_bytes": wbytes,
           "cublas": stats(time_per_call(reduced(lambda i: F.linear(x, ws[i])), n_w)),
           "table_kernel": "triton_gemv" if table else "cublas"}
    row["table"] = (stats(time_per_call(reduced(lambda i: g.skinny_linear(x, ws[i])), n_w))
                    if table else dict(row["cublas"]))
    deadline, tried = time.perf_counter() + budget_s, []
    for cfg in split_configs(g, shape, M):
        if time.perf_counter() > deadline:
            row["sweep_cut_by_budget"] = True
            break
        entry = {"config": cfg._asdict()}
        try:
            ref = reduced(lambda i: g.skinny_linear(x, ws[i], config=cfg))(0)
            out = deferred(cfg)(0)
            torch.cuda.synchronize()
            entry["same_bits"] = all(torch.equal(a, b) for a, b in zip(out, ref))
            entry["deferred"] = stats(time_per_call(deferred(cfg), n_w))
            entry["reduced"] = stats(time_per_call(
                reduced(lambda i: g.skinny_linear(x, ws[i], config=cfg)), n_w))
        except Exception as e:  # does not compile / fit: record and go on
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        tried.append(entry)
    row["split"] = tried
    ok = [t for t in tried if "deferred" in t and t["same_bits"]]
    if ok:
        row["best"] = min(ok, key=lambda t: t["deferred"]["us"])
        row["speedup_vs_table"] = row["table"]["us"] / row["best"]["deferred"]["us"]
    ws.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = sweep_parser(__doc__.splitlines()[0], case_budget_s=40.0)
    p.add_argument("--shape", choices=list(SHAPES), default="down")
    p.add_argument("--rows", nargs="*", type=int, default=[1, 32, 64, 128])
    args = p.parse_args()
    result, copy_bw = start_sweep()
    print(f"{'M':>3} | {'cuBLAS+norm':>11} | {'table+norm':>10} ({'kernel':11}) | "
          f"{'deferred':>8} {'(reduced)':>9} {'x table':>7}  best config")
    for M in args.rows:
        try:
            row = run_case(args.shape, M, copy_bw, args.case_budget_s)
        except Exception:
            result["errors"].append(f"M={M}: {traceback.format_exc()}")
            print(f"{M:3} | failed: {traceback.format_exc().splitlines()[-1]}", flush=True)
            continue
        result["cases"].append(row)
        best = row.get("best")
        bad = sum(not t.get("same_bits", True) for t in row["split"])
        print(f"{M:3} | {row['cublas']['us']:11.2f} | {row['table']['us']:10.2f} "
              f"({row['table_kernel']:11}) | "
              + (f"{best['deferred']['us']:8.2f} {best['reduced']['us']:9.2f} "
                 f"{row['speedup_vs_table']:7.2f}  {best['config']}" if best else "    none")
              + f"  ({sum('error' in t for t in row['split'])} failed, {bad} differ)", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.configs_out:
        write_winners(args.configs_out, result["cases"], args.min_gain,
                      lambda r: r["best"]["config"])


if __name__ == "__main__":
    main()
