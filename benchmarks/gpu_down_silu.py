"""The gated MLP and the residual add + RMSNorm after it, on one GPU, side by side: the engine's
current path (the table's fused gate/up + SiLU and down kernels, or cuBLAS + the SiLU kernel), all
cuBLAS (gate/up, the SiLU kernel, down), and cuBLAS gate/up followed by the down GEMM with the
SiLU · up in its prologue (rollout/layers/triton_down_silu.py) over a sweep of TMA tile configs.
Qwen2-1.5B's MLP (hidden 1,536, intermediate 8,960) in bf16, at decode batches and prefill chunks.

Times as benchmarks/gpu_gemv.py: a CUDA graph of back-to-back (MLP, add + norm) calls rotating
weight copies larger than L2, so each call reads its weights from HBM; under PDL the calls chain
as in the engine. Every config is checked: the add + norm's output against the all-cuBLAS path's
(relative error), and down_silu against the TMA GEMM of silu_and_mul's output with the same
config (the same bits). Writes the JSON and a configs file (`--configs-out`, entries of kind
"down_silu" for benchmarks/engine_ab.py) with the best config per row count that beats the
current path by `--min-gain`.

  python benchmarks/gpu_down_silu.py --rows 64 128 8192 --out $OUT/down_silu.json \
      --configs-out $OUT/down_silu_configs.json
"""
from __future__ import annotations

import json
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.gpu_gemm_tma import candidates as tma_candidates
from benchmarks.gpu_gemv import rel_err, start_sweep, sweep_parser, time_per_call, weight_copies

HIDDEN, INTER = 1536, 8960
EPS = 1e-6
DEVICE = "cuda"
DTYPE = torch.bfloat16


def configs(g, M: int) -> list:
    """TMA tiles for the down GEMM at M rows, the table's down entry first (the likeliest first)."""
    out = []
    table = g._TUNED.get((g.triton.next_power_of_2(M), HIDDEN, INTER, False))
    if table is not None and table.tma:
        out.append(table)
    if M > 256:  # a prefill chunk: wide tiles, no split
        out += [g.Config(n, 64, 1, w, True, s, 128, tma=True)
                for n, w, s in ((128, 8, 4), (256, 8, 3), (128, 8, 3), (128, 4, 4), (256, 8, 4),
                                (64, 4, 4), (64, 8, 4))]
        return out
    for c in tma_candidates(M, "down"):
        out.append(g.Config(c["block_n"], c["block_k"], c["split_k"], c["num_warps"], True,
                            c["num_stages"], c["block_m"], tma=True, swap_ab=c["swap_ab"],
                            prefetch_k=table.prefetch_k if table is not None else 0))
    return list(dict.fromkeys(out))


def run_case(M: int, copy_bw: float, budget_s: float) -> dict:
    from rollout.layers import linear as lin
    from rollout.layers import triton_down_silu, triton_gemm_tma, triton_ops
    from rollout.layers import triton_gemv as g
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    wgu = weight_copies(2 * INTER, HIDDEN, gen)
    wd = weight_copies(HIDDEN, INTER, gen)[:len(wgu)]
    n_w = min(len(wgu), len(wd))
    x = torch.randn(M, HIDDEN, device=DEVICE, dtype=DTYPE, generator=gen)
    res = torch.randn(M, HIDDEN, device=DEVICE, dtype=DTYPE, generator=gen)
    nw = torch.rand(HIDDEN, device=DEVICE, dtype=DTYPE, generator=gen) + 0.5
    wbytes = (wgu[0].numel() + wd[0].numel()) * 2

    def norm(h):  # the add + norm that reads the MLP's output (its partials, when split)
        if isinstance(h, torch.Tensor):
            return triton_ops.fused_add_rms_norm(h, res, nw, EPS)
        return triton_ops.split_add_rms_norm(h, res, nw, EPS)

    def current(i):  # the engine's MLP before this kernel (models/llama.py MLP.forward)
        if lin.use_skinny(x, wgu[i], gated=True):
            act = g.skinny_gate_up_silu(x, wgu[i], INTER)
        else:
            act = triton_ops.silu_and_mul(F.linear(x, wgu[i]))
        return norm(lin.linear(act, wd[i], defer_split=True))

    def cublas(i):
        return norm(F.linear(triton_ops.silu_and_mul(F.linear(x, wgu[i])), wd[i]))

    def fused(cfg):
        return lambda i: norm(triton_down_silu.down_silu(F.linear(x, wgu[i]), wd[i], cfg,
                                                         defer_split=True))

    def stats(seconds: float) -> dict:
        return {"us": seconds * 1e6, "weight_frac_copy": wbytes / seconds / copy_bw}

    ref = cublas(0)[0]
    row = {"M": M, "weight_bytes": wbytes, "cublas": stats(time_per_call(cublas, n_w)),
           "current": stats(time_per_call(current, n_w)),
           "current_rel_err": rel_err(current(0)[0], ref)}
    deadline, tried = time.perf_counter() + budget_s, []
    gate_up = F.linear(x, wgu[0])
    act = triton_ops.silu_and_mul(gate_up)
    for cfg in configs(g, M):
        if time.perf_counter() > deadline:
            row["sweep_cut_by_budget"] = True
            break
        entry = {"config": cfg._asdict()}
        try:
            out = triton_down_silu.down_silu(gate_up, wd[0], cfg)
            same = triton_gemm_tma.launch(act, wd[0], None, torch.empty_like(out), False, cfg)
            entry["same_bits"] = bool(torch.equal(out, same))
            entry["rel_err"] = rel_err(fused(cfg)(0)[0], ref)
            entry["fused"] = stats(time_per_call(fused(cfg), n_w))
        except Exception as e:  # does not compile / fit: record and go on
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        tried.append(entry)
    row["down_silu"] = tried
    ok = [t for t in tried if "fused" in t and t["same_bits"] and t["rel_err"] < 1e-2]
    if ok:
        row["best"] = min(ok, key=lambda t: t["fused"]["us"])
        row["speedup_vs_current"] = row["current"]["us"] / row["best"]["fused"]["us"]
    wgu.clear()
    wd.clear()
    return row


def write_configs(path: str, cases: list[dict], min_gain: float) -> None:
    """Entries of kind down_silu (gemv_launch.load_tuned) where the best config beats the
    current path by min_gain; null (off) elsewhere."""
    from rollout.layers import triton_gemv as g
    entries = []
    for row in cases:
        best = row.get("best")
        win = best is not None and row["speedup_vs_current"] >= min_gain
        entries.append({"kind": "down_silu", "M": g.triton.next_power_of_2(row["M"]),
                        "N": HIDDEN, "K": INTER, "gated": False,
                        "config": best["config"] if win else None})
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)


def main() -> None:
    p = sweep_parser(__doc__.splitlines()[0], case_budget_s=60.0)
    p.add_argument("--rows", nargs="*", type=int, default=[64, 128, 8192])
    args = p.parse_args()
    result, copy_bw = start_sweep()
    print(f"{'M':>5} | {'cuBLAS':>8} | {'current':>8} | {'down_silu':>9} {'x current':>9}  best")
    for M in args.rows:
        try:
            row = run_case(M, copy_bw, args.case_budget_s)
        except Exception:
            result["errors"].append(f"M={M}: {traceback.format_exc()}")
            print(f"{M:5} | failed: {traceback.format_exc().splitlines()[-1]}", flush=True)
            continue
        result["cases"].append(row)
        best = row.get("best")
        bad = sum(not t.get("same_bits", True) for t in row["down_silu"])
        print(f"{M:5} | {row['cublas']['us']:8.2f} | {row['current']['us']:8.2f} | "
              + (f"{best['fused']['us']:9.2f} {row['speedup_vs_current']:9.3f}  {best['config']}"
                 if best else "     none")
              + f"  ({sum('error' in t for t in row['down_silu'])} failed, {bad} differ)",
              flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.configs_out:
        write_configs(args.configs_out, result["cases"], args.min_gain)


if __name__ == "__main__":
    main()
