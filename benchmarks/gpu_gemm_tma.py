"""Decode-batch GEMMs on one GPU, side by side: cuBLAS (+ the SiLU kernel for gate/up), the
table's current path (triton_gemv's entry for the shape and rows, else cuBLAS) and the TMA-fed
tensor-core kernel (rollout/layers/triton_gemm_tma.py) over a sweep of tile configs, Qwen2-1.5B
shapes in bf16 at 1-256 rows (decode batches) and a prefill chunk of thousands.

Times as benchmarks/gpu_gemv.py (a CUDA graph of back-to-back calls rotating weight copies
larger than L2, so each call reads its weight from HBM). Each config is also checked: relative
error against cuBLAS and the same bits on a second call. Writes the JSON and a configs file
(`--configs-out`, for ROLLOUT_SKINNY_CONFIGS / benchmarks/engine_ab.py) with the best TMA config
of every case where it beats the current path.

  python benchmarks/gpu_gemm_tma.py --out $OUT/tma.json --configs-out $OUT/tma_configs.json
"""
from __future__ import annotations

import json
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.gpu_gemv import (SHAPES, rel_err, start_sweep, sweep_parser, time_per_call,
                                 use_model, weight_copies, write_winners)


KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k", "swap_ab")


def candidates(M: int, name: str = "") -> list[dict]:
    """TMA tile configs (m, n, k, warps, stages, split along K, swapped A/B), the likeliest first
    (the sweep may be cut by the budget)."""
    if M == 1:
        return _dicts(_one_row(name))
    if M > 256:  # a prefill chunk: large tiles
        return _dicts([(128, n, 64, 8, s, 1, False) for n in (64, 128) for s in (3, 4)]
                      + [(128, 64, 64, 4, 3, 1, False), (64, 128, 64, 4, 4, 1, False),
                         (128, 128, 32, 8, 5, 1, False)])
    bm = min(128, max(64, 1 << (M - 1).bit_length()))
    block_ms = [bm, 64] if bm == 128 else [bm]
    first = []
    if name == "down":  # K = 8,960: split it, or 96 programs of 64 x 32 leave SMs idle;
        # wide N tiles read x (M x 8,960) fewer times, the split makes up the programs
        splits = (((128, 10), (128, 7), (64, 5), (64, 7), (128, 14), (64, 4))
                  if SHAPES[name][1] == 8960 else  # Qwen3-1.7B's 6,144: 48 chunks of 128
                  ((128, 6), (128, 8), (64, 4), (64, 6), (128, 12), (64, 3)))
        first = [(bm, n, k, w, st, sp, False) for n, sp in splits
                 for k, w, st in ((128, 4, 4), (128, 8, 4), (64, 4, 6))]
    if name == "down" and M >= 128:  # the weight tile on wgmma's 64-row side, 128 x rows
        sp = splits[2][1]
        first = [(bm, 64, 128, 4, 4, sp, True), (bm, 64, 64, 4, 6, sp, True),
                 (64, 64, 128, 4, 4, sp, True), (bm, 128, 64, 8, 4, splits[1][1], True)] + first
    elif name == "gate_up" and M >= 128:  # swapped A/B, then the rest of the ninth session's
        first = [(128, 64, 64, 4, 3, 1, True), (64, 64, 64, 4, 4, 1, True),
                 (64, 64, 128, 4, 3, 1, True), (128, 64, 64, 8, 3, 1, True),
                 (64, 128, 64, 4, 3, 1, True), (128, 64, 128, 8, 2, 1, True),
                 (64, 64, 64, 4, 3, 1, True)]
        first += [(128, 32, 64, 4, 2, 1, False), (128, 32, 128, 4, 2, 1, False),
                 (64, 32, 64, 4, 3, 1, False), (64, 32, 64, 4, 2, 1, False),
                 (128, 16, 128, 4, 3, 1, False), (128, 16, 128, 4, 4, 1, False),
                 (128, 16, 64, 4, 4, 1, False), (128, 32, 64, 8, 2, 1, False)]
    if M <= 64:  # the weight tile on wgmma's 64-row side, x's rows on the narrow one
        first += [(M, n, k, 4, s, 1, True) for n in (64, 128) for k, s in ((128, 4), (64, 6))]
    elif name in ("qkv", "o", "lm_head"):
        first += [(m, 64, k, 4, s, 1, True) for m in (64, 128) for k, s in ((128, 4), (64, 6))]
    # the ninth session's winners, then its first sweep's order
    first += [(64, 32, 128, 4, 6, 1, False), (64, 32, 64, 4, 4, 1, False)] + [
        (bm, 64, 64, 4, s, 1, False) for s in (4, 6, 3)] + [
        (64, 64, 64, 4, 5, 1, False), (bm, 128, 64, 8, 4, 1, False),
        (bm, 64, 128, 4, 3, 1, False), (bm, 32, 64, 4, 6, 1, False)]
    rest = [(m, n, k, w, s, 1, False) for m in block_ms for n in (32, 64, 128)
            for k in (64, 128) for w in (4, 8) for s in (3, 4, 5, 6)]
    return _dicts(first + rest)


def narrow(M: int, name: str) -> list[dict]:
    """qkv and o at decode batches with weight tiles 16 rows wide (twice the programs of the
    table's 32: 2,048 / 1,536 columns over 132 SMs leave many idle at 32-64 rows), and split
    along K; the table's entry is the run's `table`."""
    bm = 128 if M >= 128 else 64
    first = [(64, 16, 128, 4, s, 1, False) for s in (4, 6, 3)] + [
        (64, 16, 256, 4, 3, 1, False), (64, 16, 64, 4, 8, 1, False),
        (bm, 16, 128, 4, 4, 1, False), (64, 32, 128, 4, 4, 2, False),
        (64, 32, 256, 4, 3, 2, False), (64, 16, 128, 8, 4, 1, False)]
    return _dicts(first)


def _one_row(name: str) -> list[tuple]:
    """One row (x padded to 16 by TMA's zero fill): swapped A/B puts the weight tile on wgmma's
    64-row side; K split where the N tiles alone are too few programs."""
    if name == "gate_up":  # 8,960 columns a half; 36 KB a stage at 64 x 128: 3 stages keep
        # two programs on an SM (140 programs of 64 columns on 132 SMs)
        return ([(16, 64, 128, 4, 3, 1, True), (16, 64, 64, 4, 6, 1, True),
                 (16, 32, 128, 4, 4, 1, True), (16, 32, 256, 4, 3, 1, True),
                 (16, 64, 256, 4, 2, 1, True), (16, 64, 128, 4, 4, 1, True),
                 (16, 128, 64, 4, 4, 1, True), (16, 32, 128, 4, 6, 1, True)]
                + [(16, n, k, 4, s, 1, False) for n, k, s in ((32, 128, 4), (32, 256, 3),
                                                              (64, 128, 3))])
    if name == "down":  # 1,536 columns, K = 8,960
        return [(16, n, k, 4, s, sp, True) for n, sp in ((64, 5), (64, 10), (64, 7), (128, 10),
                                                        (64, 4), (128, 7))
                for k, s in ((128, 4), (256, 3), (128, 6))]
    return [(16, n, k, 4, s, sp, True) for n, sp in ((64, 4), (64, 2), (64, 6), (128, 4), (64, 1))
            for k, s in ((128, 4), (256, 2))]


def _dicts(configs: list[tuple]) -> list[dict]:
    seen, out = set(), []
    for c in configs:
        if c not in seen:
            seen.add(c)
            out.append(dict(zip(KEYS, c)))
    return out


def run_case(name: str, M: int, copy_bw: float, budget_s: float, narrow_only: bool = False) -> dict:
    from rollout.layers import triton_gemv as g, triton_ops
    N, K, has_bias, gated = SHAPES[name]
    wbytes = N * K * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(N, K, gen)
    n_w = len(ws)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen) if has_bias else None
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run(cfg):  # cfg: None = cuBLAS, "table" = the current path, else a TMA config dict
        if isinstance(cfg, dict):
            c = g.Config(cfg["block_n"], cfg["block_k"], cfg["split_k"], cfg["num_warps"], True,
                         cfg["num_stages"], cfg["block_m"], tma=True, swap_ab=cfg["swap_ab"])
            if M > g.BATCH_MAX_M:  # a prefill chunk: the TMA kernel itself, past the table
                from rollout.layers import triton_gemm_tma as t
                width = N // 2 if gated else N
                return lambda i: t.launch(x, ws[i], bias, torch.empty(M, width, device="cuda",
                                                                      dtype=x.dtype), gated, c)
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
    for c in (narrow(M, name) if narrow_only else candidates(M, name)):
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
    ws.clear()  # the weight copies go before the next case
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = sweep_parser(__doc__.splitlines()[0], case_budget_s=25.0)
    p.add_argument("--shapes", nargs="*", default=["gate_up", "down", "qkv", "o"])
    p.add_argument("--rows", nargs="*", type=int, default=[128, 64, 32])
    p.add_argument("--narrow", action="store_true",
                   help="sweep only the narrow-tile configs of qkv / o (against the table, cuBLAS)")
    args = p.parse_args()
    use_model(args.model)
    result, copy_bw = start_sweep()
    result["model"] = args.model
    print(f"{'shape':8} {'M':>3} | {'cuBLAS':>7} | {'table':>7} | {'TMA':>8} "
          f"{'x cuBLAS':>8} {'x table':>7}  best config (m, n, k, warps, stages, split, swap)")
    for M in args.rows:
        for name in args.shapes:
            try:
                row = run_case(name, M, copy_bw, args.case_budget_s, args.narrow)
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
        write_winners(args.configs_out, result["cases"], args.min_gain,
                      lambda r: {"dot": True, "tma": True, **r["best"]["config"]})


if __name__ == "__main__":
    main()
