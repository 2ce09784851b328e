"""The fused gate/up + SiLU at decode batches with its weight rows split evenly over a fixed
number of programs (rollout/layers/triton_gate_up_even.py), side by side with the table's kernel
and cuBLAS + the SiLU kernel: Qwen2-1.5B's gate/up (17,920 x 1,536) in bf16.

Times as benchmarks/gpu_gemv.py (a CUDA graph of back-to-back calls rotating weight copies larger
than L2, so each call reads its weight from HBM). Each config is checked: relative error against
cuBLAS + SiLU and the same bits on a second call. Writes the JSON and a configs file
(`--configs-out`, for benchmarks/engine_ab.py) with the best config per row count that beats the
table by `--min-gain`.

  python benchmarks/gpu_gate_up_even.py --rows 128 64 --out $OUT/even.json \
      --configs-out $OUT/even_configs.json
"""
from __future__ import annotations

import json
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.gpu_gemv import (rel_err, start_sweep, sweep_parser, time_per_call,
                                 weight_copies, write_winners)

HIDDEN, INTER = 1536, 8960


def configs(g, M: int) -> list:
    """Even-split configs (unit rows, K chunk, warps, stages, programs), the likeliest first."""
    bm = max(64, g.triton.next_power_of_2(M))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for programs in (sms, 140, 2 * sms, 280):
        for bk, warps, stages in ((64, 8, 4), (64, 4, 4), (64, 8, 5), (128, 8, 3), (64, 8, 3),
                                  (128, 4, 3), (32, 8, 6)):
            out.append(g.Config(16, bk, 1, warps, True, stages, bm, even_programs=programs))
    return out


def run_case(M: int, copy_bw: float, budget_s: float) -> dict:
    from rollout.layers import triton_gate_up_even, triton_ops
    from rollout.layers import triton_gemv as g
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(2 * INTER, HIDDEN, gen)
    n_w = len(ws)
    x = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    wbytes = ws[0].numel() * 2

    def stats(seconds: float) -> dict:
        return {"us": seconds * 1e6, "weight_frac_copy": wbytes / seconds / copy_bw}

    ref = triton_ops.silu_and_mul(F.linear(x, ws[0]))
    table = g._config(M, 2 * INTER, HIDDEN, True)
    row = {"M": M, "N": 2 * INTER, "K": HIDDEN, "gated": True, "weight_bytes": wbytes,
           "cublas": stats(time_per_call(
               lambda i: triton_ops.silu_and_mul(F.linear(x, ws[i])), n_w)),
           "table_config": table._asdict(),
           "table": stats(time_per_call(lambda i: g.skinny_gate_up_silu(x, ws[i], INTER), n_w))}
    deadline, tried = time.perf_counter() + budget_s, []
    for cfg in configs(g, M):
        if time.perf_counter() > deadline:
            row["sweep_cut_by_budget"] = True
            break
        entry = {"config": cfg._asdict()}
        try:
            triton_gate_up_even.main_units(INTER, cfg)
            a = g.skinny_gate_up_silu(x, ws[0], INTER, config=cfg)
            b = g.skinny_gate_up_silu(x, ws[0], INTER, config=cfg)
            entry["rel_err"] = rel_err(a, ref)
            entry["same_bits"] = bool(torch.equal(a, b))
            entry["even"] = stats(time_per_call(
                lambda i: g.skinny_gate_up_silu(x, ws[i], INTER, config=cfg), n_w))
        except Exception as e:  # does not compile / fit / split: record and go on
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        tried.append(entry)
    row["even_split"] = tried
    ok = [t for t in tried if "even" in t and t["same_bits"] and t["rel_err"] < 1e-2]
    if ok:
        row["best"] = min(ok, key=lambda t: t["even"]["us"])
        row["speedup_vs_table"] = row["table"]["us"] / row["best"]["even"]["us"]
    ws.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = sweep_parser(__doc__.splitlines()[0], case_budget_s=60.0)
    p.add_argument("--rows", nargs="*", type=int, default=[128, 64])
    args = p.parse_args()
    result, copy_bw = start_sweep()
    print(f"{'M':>4} | {'cuBLAS+SiLU':>11} | {'table':>7} | {'even':>7} {'x table':>7}  best")
    for M in args.rows:
        try:
            row = run_case(M, copy_bw, args.case_budget_s)
        except Exception:
            result["errors"].append(f"M={M}: {traceback.format_exc()}")
            print(f"{M:4} | failed: {traceback.format_exc().splitlines()[-1]}", flush=True)
            continue
        result["cases"].append(row)
        best = row.get("best")
        print(f"{M:4} | {row['cublas']['us']:11.2f} | {row['table']['us']:7.2f} | "
              + (f"{best['even']['us']:7.2f} {row['speedup_vs_table']:7.3f}  {best['config']}"
                 if best else "   none")
              + f"  ({sum('error' in t for t in row['even_split'])} failed)", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.configs_out:
        write_winners(args.configs_out, result["cases"], args.min_gain,
                      lambda r: r["best"]["config"])


if __name__ == "__main__":
    main()
