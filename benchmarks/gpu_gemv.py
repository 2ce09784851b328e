"""Skinny decode GEMMs on one GPU: cuBLAS (F.linear) vs rollout/layers/triton_gemv.py, Qwen2-1.5B
shapes in bf16, M in {1, 2, 4, 8, 16} and decode batches of 32-256 rows (the M-tiled kernel),
with the default launch config and a sweep of candidates.

Every time is a CUDA graph of CALLS back-to-back calls, replayed and divided, so launch overhead
does not dominate; calls rotate among enough copies of the weight (> 2x the 50 MB L2 of an H200)
that each reads it from HBM. Reported: µs per call, weight GB/s, the fraction of a large
device-to-device copy's bandwidth (bytes read + written, as decode_throughput.copy_bandwidth),
and each kernel's relative error (norm of the difference / norm) against cuBLAS. gate_up is the
fused skinny_gate_up_silu against F.linear + triton_ops.silu_and_mul. Ends with a dict literal of
the best config per shape and M, to paste into triton_gemv._TUNED.

  python benchmarks/gpu_gemv.py --out $OUT/gemv.json [--budget-s 180]
"""
from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import replay_seconds

MODEL_SHAPES = {  # model: {name: (N weight rows, K, bias, gated)}
    "qwen2-1.5b": {
        "qkv": (2048, 1536, True, False),
        "o": (1536, 1536, False, False),
        "gate_up": (17920, 1536, False, True),
        "down": (1536, 8960, False, False),
        "lm_head": (151936, 1536, False, False),
    },
    "qwen3-1.7b": {  # 16 / 8 heads of 128 (no qkv bias), intermediate 6,144
        "qkv": (4096, 2048, False, False),
        "o": (2048, 2048, False, False),
        "gate_up": (12288, 2048, False, True),
        "down": (2048, 6144, False, False),
        "lm_head": (151936, 2048, False, False),
    },
}
SHAPES = dict(MODEL_SHAPES["qwen2-1.5b"])  # the swept model's (use_model)


def use_model(model: str) -> None:
    """Sweep `model`'s shapes: SHAPES is updated in place, so the scripts that imported it see
    them."""
    SHAPES.clear()
    SHAPES.update(MODEL_SHAPES[model])


ROWS = [1, 2, 4, 8, 16]
SWEEP_ROWS = {1, 8, 16}  # the full sweep; M = 2, 4 get the default and a few alternatives
CALLS = 50  # calls per captured graph
ROTATE_BYTES = 120e6  # weight copies per shape: > 2x L2


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by one large device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def weight_copies(N: int, K: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random bf16 [N, K] weights (scaled by K^-1/2), as many copies as make calls rotating over
    them read each from HBM (> 2x L2 in all, at most CALLS)."""
    n_w = max(1, min(CALLS, math.ceil(ROTATE_BYTES / (N * K * 2))))
    return [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K ** -0.5
            for _ in range(n_w)]


def run_info(copy_bw: float) -> dict:
    """The device, library versions and copy bandwidth a sweep's JSON starts with."""
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, copy_bandwidth_GBps=copy_bw / 1e9)


def sweep_parser(description: str, case_budget_s: float) -> argparse.ArgumentParser:
    """The options of a per-case config sweep (gpu_gemm_tma, gpu_split_norm): JSON out, the
    configs file of the winners, a time budget a case, the gain a winner needs."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True)
    p.add_argument("--configs-out", default=None)
    p.add_argument("--case-budget-s", type=float, default=case_budget_s)
    p.add_argument("--min-gain", type=float, default=1.02, help="configs file: faster by this")
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="qwen2-1.5b",
                   help="whose GEMM shapes (use_model)")
    return p


def write_winners(path: str, cases: list[dict], min_gain: float, config_of) -> None:
    """A sweep's configs file (for ROLLOUT_SKINNY_CONFIGS / benchmarks/engine_ab.py): the best
    config (`config_of(case)`) of each case that beats the table's path by `min_gain`."""
    entries = [{"M": r["M"], "N": r["N"], "K": r["K"], "gated": r.get("gated", False),
                "config": config_of(r)}
               for r in cases if r.get("speedup_vs_table", 0) >= min_gain]
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)
    print(f"{len(entries)} entries -> {path}")


def start_sweep() -> tuple[dict, float]:
    """A sweep's result dict (errors, cases, run_info) and the copy bandwidth it measured."""
    copy_bw = copy_bandwidth()
    return {"errors": [], "cases": [], **run_info(copy_bw)}, copy_bw


def time_per_call(fn, n_weights: int, replays: int = 10) -> float:
    """Seconds per fn(i) call, i cycling over the weight copies, in a graph of CALLS calls."""
    for i in range(2):  # compile and warm up outside the capture
        fn(i % n_weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % n_weights)
    seconds = replay_seconds(graph, replays) / CALLS
    del graph
    return seconds


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def even_split(g, rows: int, K: int, block_n: int, block_k: int, min_chunks: int) -> int:
    """Programs along K, as the heuristic's: the largest even split (at least `min_chunks` K
    chunks each) before the N blocks times the split fill the SMs twice."""
    chunks, s = math.ceil(K / block_k), 1
    for c in range(2, g.MAX_SPLIT_K + 1):
        if math.ceil(rows / block_n) * s >= 2 * g.NUM_SMS_H200:
            break
        if chunks % c == 0 and chunks // c >= min_chunks:
            s = c
    return s


def candidates(g, M: int, N: int, K: int, gated: bool) -> list:
    """Configs to try for one case, the default first."""
    Config = g.Config
    default = g._config(M, N, K, gated)
    out = [default]
    rows = N // 2 if gated else N

    def split_for(block_n, block_k):
        return even_split(g, rows, K, block_n, block_k, min_chunks=2)

    if M > g.MAX_M and not gated:  # decode batches: M tiles, split-K where N alone leaves SMs idle
        for bm in (32, 64, 128):
            for bn in (32, 64, 128):
                for bk in (64, 128):
                    if bm * bn > 8192 or bm > max(32, M):
                        continue
                    warps = 4 if bm * bn <= 4096 else 8
                    tiles = math.ceil(M / bm) * math.ceil(rows / bn)
                    chunks, splits = math.ceil(K / bk), {1}
                    for s in range(2, g.MAX_SPLIT_K + 1):
                        if chunks % s == 0 and chunks // s >= 4:
                            splits.add(s)
                            if tiles * s >= g.NUM_SMS_H200:
                                break
                    for s in sorted({1, *sorted(splits)[-2:]}):  # no split, and the fullest two
                        out.append(Config(bn, bk, s, warps, True, 3, bm))
    elif M > g.MAX_M:  # decode batches, fused gate/up + SiLU: M tiles on the tensor cores
        for bm in (64, 128):
            for bn in (32, 64, 128):
                for bk in (64, 128):
                    if bm * bn <= 8192:
                        out.append(Config(bn, bk, 1, 4 if bm * bn <= 4096 else 8, True, 3, bm))
        out += [Config(64, 64, 1, 8, True, 4, 128), Config(64, 64, 1, 4, True, 4, 64),
                Config(128, 64, 1, 8, True, 3, 64)]
    elif M == 1 and rows * K <= 32 << 20:  # the small matrices, where launch and ramp dominate
        for bn in (2, 4, 8):
            for bk in (256, 512, 1024):
                for nw in (2, 4, 8):
                    out.append(Config(bn, bk, 1, nw, False))
        for bn in (4, 8, 16):
            for bk in (128, 256):
                chunks = math.ceil(K / bk)
                for s in (2, 4, 5, 7, 10):
                    if chunks % s == 0 and chunks // s >= 2:
                        out.append(Config(bn, bk, s, 4, False))
    elif M == 1:
        for bn in (4, 8, 16):
            for bk in (256, 512):
                for nw in ((4,) if bn == 4 else (4, 8)):
                    out.append(Config(bn, bk, 1, nw, False))
        for bn, bk in ((4, 256), (8, 256)):
            s = split_for(bn, bk)
            if s > 1:
                out.append(Config(bn, bk, s, 4, False))
    elif SMALL_BATCH_SWEEP:  # 2-16 rows: the one-row kernel's tuned entry and its neighbours
        out += small_batch_candidates(g, M, N, K, gated)
    elif M in SWEEP_ROWS:
        for bn in (16, 32, 64):
            for bk in (128, 256):
                out.append(Config(bn, bk, 1, 4, True))
                s = split_for(bn, bk)
                if s > 1 and bn <= 32:
                    out.append(Config(bn, bk, s, 4, True))
        out.append(default._replace(num_stages=4))
        out.append(default._replace(num_warps=8))
    else:  # M = 2, 4: the FMA kernel at its BLOCK_M, and the dot default with/without split
        out.append(Config(4, 512 if K % 512 == 0 else 256, 1, 4, False))
        out.append(Config(8, 256, 1, 4, False))
        out.append(default._replace(split_k=1))
    if M == 1:  # each FMA config also with the next K chunk's load issued before its FMA
        out += [c._replace(lookahead=True) for c in out if not c.dot]
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


SMALL_BATCH_SWEEP = False  # --small-batches: the candidates below at 2-16 rows


def small_batch_candidates(g, M: int, N: int, K: int, gated: bool) -> list:
    """Candidates at 2-16 rows (a rollout's small decode batches). Up to 4 rows the FMA kernel
    with the one-row table entry's preloads (weights loaded before the PDL wait) and fewer rows
    a program or more warps (its fp32 products are [M, rows, K chunk] registers, and x is read
    once a program: the first sweep, small30, lost past 4 rows with it). At every M tensor-core
    tiles (x padded to 16 rows) with their first K chunks loaded before the PDL wait or not,
    split along K where the N blocks leave SMs idle."""
    Config, out = g.Config, []
    one = g._TUNED.get((1, N, K, gated))
    if one is not None and not one.dot and M <= 4:
        out.append(one)
        if one.block_n > 1:
            out.append(one._replace(block_n=one.block_n // 2))
        if M == 2:
            out.append(one._replace(num_warps=2 * one.num_warps))
    rows = N // 2 if gated else N
    for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 128)):
        s = even_split(g, rows, K, bn, bk, min_chunks=4)
        for preload in (0, 2):
            out.append(Config(bn, bk, s, 4, True, dot_preload=preload))
    return out


def run_case(g, triton_ops, name: str, M: int, copy_bw: float, deadline: float) -> dict:
    N, K, has_bias, gated = SHAPES[name]
    dtype = torch.bfloat16
    wbytes = N * K * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(N, K, gen)
    n_w = len(ws)
    bias = torch.randn(N, device="cuda", dtype=dtype, generator=gen) if has_bias else None
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
    inter = N // 2

    if gated:
        def cublas(i):
            return triton_ops.silu_and_mul(F.linear(x, ws[i]))

        def triton_fn(cfg):
            return lambda i: g.skinny_gate_up_silu(x, ws[i], inter, config=cfg)
    else:
        def cublas(i):
            return F.linear(x, ws[i], bias)

        def triton_fn(cfg):
            return lambda i: g.skinny_linear(x, ws[i], bias, config=cfg)

    def stats(seconds: float) -> dict:
        gbps = wbytes / seconds / 1e9
        return {"us": seconds * 1e6, "GBps": gbps, "frac_copy": gbps * 1e9 / copy_bw}

    ref = cublas(0)
    row = {"name": name, "M": M, "N": N, "K": K, "gated": gated, "bias": has_bias,
           "weight_bytes": wbytes, "weight_copies": n_w,
           "cublas": stats(time_per_call(cublas, n_w))}
    tried = []
    for j, cfg in enumerate(candidates(g, M, N, K, gated)):
        if j > 0 and time.perf_counter() > deadline:
            row["sweep_cut_by_budget"] = True
            break
        entry = {"config": cfg._asdict(), "default": j == 0}
        try:
            fn = triton_fn(cfg)
            entry["rel_err"] = rel_err(fn(0), ref)
            entry.update(stats(time_per_call(fn, n_w)))
        except Exception as e:  # a config that does not compile/fit: record and go on
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        tried.append(entry)
    row["triton"] = tried
    ok = [t for t in tried if "us" in t and t["rel_err"] <= 1e-2]
    if ok:
        best = min(ok, key=lambda t: t["us"])
        row["best"] = best
        row["speedup_best_vs_cublas"] = row["cublas"]["us"] / best["us"]
    if tried and "us" in tried[0]:
        row["speedup_default_vs_cublas"] = row["cublas"]["us"] / tried[0]["us"]
    del ws
    torch.cuda.empty_cache()
    return row


def fmt(t) -> str:
    return f"{t['us']:8.2f} {t['GBps']:7.0f} {100 * t['frac_copy']:5.1f}%" if t and "us" in t \
        else f"{'-':>8} {'-':>7} {'-':>6}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file, rewritten after every case")
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="stop sweeping (defaults still run) after this many seconds")
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="qwen2-1.5b",
                   help="whose GEMM shapes (use_model)")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--rows", nargs="*", type=int, default=ROWS)
    p.add_argument("--batch-rows", nargs="*", type=int, default=[32, 64, 128, 256],
                   help="decode batches (the M-tiled kernel), for every shape but the LM head")
    p.add_argument("--small-batches", action="store_true",
                   help="at 2-16 rows sweep the FMA kernel's preloading configs and dot tiles "
                        "(small_batch_candidates)")
    p.add_argument("--configs-out", default=None,
                   help="JSON for gemv_launch.load_tuned / ROLLOUT_SKINNY_CONFIGS: the best config "
                        "per case, null where cuBLAS was faster")
    args = p.parse_args()
    use_model(args.model)
    global SMALL_BATCH_SWEEP
    SMALL_BATCH_SWEEP = args.small_batches
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    result: dict = {"cases": [], "errors": []}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    try:
        from rollout.layers import triton_gemv as g
        from rollout.layers import triton_ops
        copy_bw = copy_bandwidth()
        result.update(run_info(copy_bw), calls_per_graph=CALLS)
        print(f"{result['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + written)")
    except Exception:
        result["errors"].append(traceback.format_exc())
        save()
        raise
    save()
    print(f"{'shape':8} {'M':>2} | {'cuBLAS µs':>8} {'GB/s':>7} {'%copy':>6} | "
          f"{'default':>8} {'GB/s':>7} {'%copy':>6} | {'best':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'x cuBLAS':>8} {'rel.err':>8}  best config")
    for name in args.shapes:
        for M in args.rows + (args.batch_rows if name != "lm_head" else []):
            try:
                row = run_case(g, triton_ops, name, M, copy_bw, deadline)
            except Exception:
                result["errors"].append(f"{name} M={M}: {traceback.format_exc()}")
                print(f"{name:8} {M:2} | failed: {traceback.format_exc().splitlines()[-1]}")
                torch.cuda.empty_cache()
                save()
                continue
            result["cases"].append(row)
            save()
            best, default = row.get("best"), row["triton"][0] if row["triton"] else None
            err = max((t["rel_err"] for t in row["triton"] if "rel_err" in t), default=float("nan"))
            cfg = tuple(best["config"].values()) if best else "-"
            print(f"{name:8} {M:2} | {fmt(row['cublas'])} | {fmt(default)} | {fmt(best)} "
                  f"{row.get('speedup_best_vs_cublas', float('nan')):8.2f} {err:8.1e}  {cfg}"
                  + (f"  ({sum('error' in t for t in row['triton'])} configs failed)"
                     if any("error" in t for t in row["triton"]) else ""))
    result["seconds"] = time.perf_counter() - t0
    save()
    print(f"\n# {result['seconds']:.0f} s. Best configs, for triton_gemv._TUNED "
          "(key: M, N weight rows, K, gated):")
    print("_TUNED = {")
    for row in result["cases"]:
        if "best" in row:
            c = row["best"]["config"]
            args_s = ", ".join(f"{k}={v!r}" for k, v in c.items())
            print(f"    ({row['M']}, {row['N']}, {row['K']}, {row['gated']}): Config({args_s}),"
                  f"  # {row['name']}: {row['best']['us']:.2f} µs, "
                  f"x{row['speedup_best_vs_cublas']:.2f} vs cuBLAS")
    print("}")
    if args.configs_out:
        entries = [{"M": r["M"], "N": r["N"], "K": r["K"], "gated": r["gated"],
                    "config": r["best"]["config"] if r.get("speedup_best_vs_cublas", 0) > 1.0 else None}
                   for r in result["cases"] if "best" in r]
        with open(args.configs_out, "w") as f:
            json.dump(entries, f, indent=1)


if __name__ == "__main__":
    main()
