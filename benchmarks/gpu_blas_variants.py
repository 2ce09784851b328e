"""Decode-batch GEMMs through cuBLAS, four ways, side by side: F.linear (x W^T) and the
transposed product W x^T (an [N, M] output: another kernel choice for cuBLAS's heuristics), each
with torch's default BLAS library and with cuBLASLt (`torch.backends.cuda.preferred_blas_library`).
Qwen2-1.5B shapes in bf16 at decode batches; timed as benchmarks/gpu_gemv.py (a CUDA graph of
back-to-back calls rotating weight copies larger than L2). Each variant's result is checked
against F.linear's (relative error).

  python benchmarks/gpu_blas_variants.py --out $OUT/blas.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.gpu_gemv import SHAPES, rel_err, time_per_call, weight_copies


def variants(x, ws, bias):
    def linear(i):
        return F.linear(x, ws[i], bias)

    def transposed(i):  # [N, M]; the bias as a column
        if bias is None:
            return torch.mm(ws[i], x.t())
        return torch.addmm(bias[:, None], ws[i], x.t())
    return {"linear": (linear, False), "transposed": (transposed, True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="*", default=["qkv", "o", "down", "gate_up"])
    p.add_argument("--rows", nargs="*", type=int, default=[128, 64, 32])
    args = p.parse_args()
    default_lib = torch.backends.cuda.preferred_blas_library()
    rows = []
    print(f"{'shape':8} {'M':>3} " + " ".join(f"{v:>22}" for v in
          ("linear/default", "linear/cublaslt", "transposed/default", "transposed/cublaslt")))
    for M in args.rows:
        for name in args.shapes:
            N, K, has_bias, _ = SHAPES[name]
            gen = torch.Generator(device="cuda").manual_seed(0)
            ws = weight_copies(N, K, gen)
            n_w = len(ws)
            bias = (torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen)
                    if has_bias else None)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x, ws[0], bias)
            row = {"name": name, "M": M, "N": N, "K": K}
            for vname, (fn, t) in variants(x, ws, bias).items():
                for lib in ("default", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(default_lib if lib == "default" else lib)
                    try:
                        out = fn(0)
                        err = rel_err(out.t() if t else out, ref)
                        row[f"{vname}/{lib}"] = {"us": time_per_call(fn, n_w) * 1e6, "rel_err": err}
                    except Exception as e:
                        row[f"{vname}/{lib}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            torch.backends.cuda.preferred_blas_library(default_lib)
            rows.append(row)
            print(f"{name:8} {M:3} " + " ".join(
                f"{row[k].get('us', float('nan')):15.2f} ({row[k].get('rel_err', float('nan')):.0e})"
                for k in ("linear/default", "linear/cublaslt", "transposed/default",
                          "transposed/cublaslt")), flush=True)
            del ws
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "default_blas": str(default_lib), "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
