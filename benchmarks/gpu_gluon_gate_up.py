"""The engine's Gluon gate/up + SiLU (rollout/layers/gluon_gemm.py) swept over its configs at
decode batches, beside what the table runs there and cuBLAS + silu_and_mul, in one process;
`--proj down|o|qkv|lm_head`: the same kernel as one of Qwen2-1.5B's plain projections (down
1,536 x 8,960, o 1,536 x 1,536, qkv 2,048 x 1,536 with its bias, split along K; the LM head
151,936 x 1,536 unsplit, in tiles whose count fills whole waves of the H200's 132 SMs), beside
the table and cuBLAS; `--prefill`: the gate/up + SiLU at a prefill chunk's thousands of rows
(128-row x tiles, two consumer warpgroups, 128 gate and 128 up rows a tile, launched past the
table's rows), beside cuBLAS + silu_and_mul, the path a prefill takes.

Qwen2-1.5B's gate/up (17,920 x 1,536), bf16; µs a call in a CUDA graph of back-to-back calls
rotating weight copies larger than L2 (benchmarks/gpu_gemv.py's timing); every Gluon result is
first checked against cuBLAS + silu_and_mul (relative error <= 1e-2, else not timed).

  python benchmarks/gpu_gluon_gate_up.py --out $OUT/gluon_gate_up_sweep.json
  python benchmarks/gpu_gluon_gate_up.py --proj o --rows 128 --out $OUT/o.json \
      --configs-out $OUT/o_configs.json
  python benchmarks/gpu_gluon_gate_up.py --prefill --rows 4096 8192 --out $OUT/prefill.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from benchmarks.gpu_gemv import rel_err, time_per_call, weight_copies

INTER, HIDDEN = 8960, 1536


def configs(rows: int, prefill: bool = False):
    from rollout.layers.triton_gemv import Config
    if prefill:  # (weight rows a tile, stages); nothing before a PDL wait: prefills take none
        for block_n, stages in ((128, 4), (128, 3), (64, 4), (64, 6), (136, 4)):
            yield Config(block_n, 64, 1, 8, True, stages, 128, preload=0, gluon=True)
        return
    for block_m, warps_list in ((64, (4,)), (128, (4, 8))):
        if block_m == 128 and rows <= 64:
            continue
        stage_list = (4, 6, 8) if block_m == 64 else (4, 6)
        for warps in warps_list:
            for stages in stage_list:
                for block_n in (64, 72, 80):
                    yield Config(block_n, 64, 1, warps, True, stages, block_m, preload=stages,
                                 gluon=True)


# plain projections of Qwen2-1.5B: (weight rows N, K, has bias)
PROJECTIONS = {"down": (HIDDEN, INTER, False), "o": (HIDDEN, HIDDEN, False),
               "qkv": (2048, HIDDEN, True), "lm_head": (151936, HIDDEN, False)}
# (weight rows a program, K ranges) per projection: about one program an SM at 128 rows
_PROJECTION_TILES = {"down": ((128, 11), (96, 8), (64, 5), (128, 8), (128, 6)),
                     "o": ((64, 4), (64, 5), (128, 8), (64, 3), (96, 8)),
                     "qkv": ((64, 4), (128, 8), (64, 2), (128, 6), (64, 3))}


def lm_head_configs(rows: int):
    """The LM head unsplit, one program an SM at a time (168-255 registers a thread hold one CTA
    an SM): 144-row tiles make 1,056 programs, 8 waves of 132; 288-row tiles 528, 4 waves;
    128- and 256-row tiles 1,187 and 594 (9 and 4.5). x's rows in one tile of 128 (8 consumer
    warps) past 64 rows, of 64 (4 warps) up to it."""
    from rollout.layers.triton_gemv import Config
    block_m, warps = (128, 8) if rows > 64 else (64, 4)
    big = 6 if block_m == 128 else 8  # stages of 144- and 128-row tiles in ~200 KB
    for block_n, stages, preload in ((144, big, 3), (128, big, 3), (288, 4, 2), (256, 4, 2),
                                     (144, big, big)):
        yield Config(block_n, 64, 1, warps, True, stages, block_m, preload=preload, gluon=True)


def projection_configs(proj: str, wide: bool = False, rows: int = 128):
    """The LM head: `lm_head_configs`. Else 8 consumer warps on 128-row x tiles, 4 or 6 stages,
    3 preloaded; `wide`: also 4 warps, 64-row x tiles (two M blocks), 8 stages, every stage
    preloaded, and the tiles at half the split."""
    from rollout.layers.triton_gemv import Config
    if proj == "lm_head":
        yield from lm_head_configs(rows)
        return
    tiles = _PROJECTION_TILES[proj]
    if wide:
        tiles += tuple((n, max(1, split // 2)) for n, split in tiles)
    for block_n, split in dict.fromkeys(tiles):
        for block_m, warps in ((128, 8), (128, 4), (64, 4)) if wide else ((128, 8),):
            for stages in (4, 6, 8) if wide else (4, 6):
                for preload in (3, stages) if wide else (3,):
                    yield Config(block_n, 64, split, warps, True, stages, block_m,
                                 preload=preload, gluon=True)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, cfg) -> torch.Tensor:
    """The Gluon gate/up + SiLU at `cfg`: through the table's entry point up to its rows, past
    them (a prefill chunk) the kernel's own launcher."""
    from rollout.layers import gluon_gemm, triton_gemv
    if x.shape[0] <= triton_gemv.BATCH_MAX_M:
        return triton_gemv.skinny_gate_up_silu(x, w, INTER, config=cfg)
    out = torch.empty(x.shape[0], INTER, dtype=x.dtype, device=x.device)
    gluon_gemm.launch(x, w, out, True, cfg)
    return out


def sweep_projection(proj: str, rows_list, out_path, configs_out, min_gain: float,
                     wide: bool = False) -> None:
    """A plain projection at each row count: cuBLAS, the table's path, the Gluon configs (the
    split ones' partials summed by the reduce kernel, as the table's; in the engine their reader
    sums them). With `configs_out`, the best Gluon config at each power-of-two row count where
    it beats the table by `min_gain`."""
    from rollout.layers import triton_gemv
    n, k, has_bias = PROJECTIONS[proj]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(n, k, gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if has_bias else None
    rows_out, entries = [], []
    for m in rows_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = F.linear(x, ws[0], b)
        row = {"rows": m,
               "cublas_us": time_per_call(lambda i: F.linear(x, ws[i], b), len(ws)) * 1e6,
               "table_us": time_per_call(lambda i: triton_gemv.skinny_linear(x, ws[i], b),
                                         len(ws)) * 1e6, "gluon": []}
        for cfg in projection_configs(proj, wide, m):
            entry = {"config": cfg._asdict()}
            try:
                entry["rel_err"] = rel_err(triton_gemv.skinny_linear(x, ws[0], b, config=cfg),
                                           ref)
            except (OutOfResources, ValueError) as e:  # --wide: 8 stages of 128-row tiles
                # (256 KB of shared memory); qkv unsplit (its bias needs a split)
                entry["error"] = str(e)
            if entry.get("rel_err", 1.0) <= 1e-2:
                entry["us"] = time_per_call(
                    lambda i: triton_gemv.skinny_linear(x, ws[i], b, config=cfg), len(ws)) * 1e6
            row["gluon"].append(entry)
            print(json.dumps(entry), flush=True)
        best = min((e for e in row["gluon"] if "us" in e), key=lambda e: e["us"], default=None)
        print(f"{proj}, rows {m}: cuBLAS {row['cublas_us']:.2f} µs, table {row['table_us']:.2f}, "
              f"best Gluon {best['us'] if best else float('nan'):.2f}", flush=True)
        rows_out.append(row)
        if best and m & (m - 1) == 0 and best["us"] * min_gain <= row["table_us"]:
            entries.append({"M": m, "N": n, "K": k, "gated": False, "config": best["config"]})
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), proj: rows_out}, f, indent=1)
    if configs_out:
        with open(configs_out, "w") as f:
            json.dump(entries, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 48, 64, 96, 128])
    p.add_argument("--configs-out", default=None, help="a configs file (gemv_launch.load_tuned) "
                   "of the best Gluon config at each power-of-two row count it beats the table "
                   "at by --min-gain, for an engine A/B")
    p.add_argument("--min-gain", type=float, default=1.02)
    p.add_argument("--proj", choices=sorted(PROJECTIONS), default=None,
                   help="sweep this plain projection (split along K) instead of gate/up")
    p.add_argument("--wide", action="store_true", help="--proj: more warps, tiles and stages")
    p.add_argument("--prefill", action="store_true",
                   help="gate/up at a prefill chunk's rows (--rows 4096 8192): its tiles")
    args = p.parse_args()
    if args.proj:
        return sweep_projection(args.proj, args.rows, args.out, args.configs_out, args.min_gain,
                                args.wide)
    entries = []
    from rollout.layers import triton_gemv, triton_ops
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(2 * INTER, HIDDEN, gen)
    rows_out = []
    for m in args.rows:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = triton_ops.silu_and_mul(F.linear(x, ws[0]))
        cublas = time_per_call(lambda i: triton_ops.silu_and_mul(F.linear(x, ws[i])), len(ws))
        on_table = triton_gemv.supports(x, ws[0], gated=True)
        table = time_per_call(
            (lambda i: triton_gemv.skinny_gate_up_silu(x, ws[i], INTER)) if on_table else
            (lambda i: triton_ops.silu_and_mul(F.linear(x, ws[i]))), len(ws))
        row = {"rows": m, "cublas_silu_us": cublas * 1e6, "table_us": table * 1e6,
               "table_kernel": "triton" if on_table else "cublas", "gluon": []}
        for cfg in configs(m, args.prefill):
            out = gate_up_silu(x, ws[0], cfg)
            entry = {"config": cfg._asdict(), "rel_err": rel_err(out, ref),
                     "same_bits_as_cublas_silu": bool(torch.equal(out, ref))}
            if entry["rel_err"] <= 1e-2:
                entry["us"] = time_per_call(lambda i: gate_up_silu(x, ws[i], cfg), len(ws)) * 1e6
            row["gluon"].append(entry)
        best = min((e for e in row["gluon"] if "us" in e), key=lambda e: e["us"], default=None)
        print(f"rows {m}: cuBLAS + SiLU {row['cublas_silu_us']:.2f} µs, table "
              f"({row['table_kernel']}) {row['table_us']:.2f}, best Gluon "
              f"{best['us'] if best else float('nan'):.2f} {best['config'] if best else ''}",
              flush=True)
        rows_out.append(row)
        if best and m & (m - 1) == 0 and best["us"] * args.min_gain <= row["table_us"]:
            entries.append({"M": m, "N": 2 * INTER, "K": HIDDEN, "gated": True,
                            "config": best["config"]})
            if args.configs_out:
                with open(args.configs_out, "w") as f:
                    json.dump(entries, f, indent=1)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
