"""Decode attention above 64 requests: the Gluon kernel (a ring of shared memory filled by cp.async
before its PDL wait, rollout/attention/triton_kernels/decode_gluon.py) against the Triton kernel
the engine launches there (decode.py, one split of 128-key blocks), side by side in one process.
The case and the timing are benchmarks/gpu_attention.py's: Qwen2-1.5B heads, bf16, a CUDA graph of
one call per layer (28), each layer's KV in its own buffers, every output checked against
float64 softmax attention (relative error <= 1e-2).

  python benchmarks/gpu_decode_gluon.py --out $OUT/decode_gluon.json
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.cuda_timing import replay_seconds
from benchmarks.gpu_attention import HEAD_DIM, HEADS, LAYERS, make_case, reference, rel_err

GLUON = [(64, 2, 4), (32, 2, 4), (64, 1, 4), (16, 4, 4), (32, 4, 4), (64, 3, 4),
         (32, 6, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", nargs="+", default=["128:129:256"],
                    metavar="BATCH:LO:HI")
    args = ap.parse_args()
    from rollout.attention.triton_kernels import decode, decode_gluon
    scale = HEAD_DIM ** -0.5
    gen = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.cases:
        batch, lo, hi = (int(v) for v in spec.split(":"))
        case = make_case(batch, gen, "engine" if hi <= 256 else "random", (lo, hi))
        ref = reference(case, 0, scale)
        out = torch.empty_like(case["q"])
        triton_cfg = decode.decode_launch_config(batch, max_keys=hi)
        kernels = {"triton " + str(tuple(triton_cfg)): None}
        kernels.update({f"gluon {c}": decode_gluon.GluonDecodeConfig(*c) for c in GLUON})

        def run(cfg, layer):
            args_ = (case["q"], case["ks"][layer], case["vs"][layer], case["req_to_token"],
                     case["rows"], case["lens"], scale)
            if cfg is None:
                return decode.decode_attention(*args_, config=triton_cfg, out=out)
            return decode_gluon.decode_attention_gluon(*args_, out, HEADS // 2, cfg)

        row = {"case": spec, "lens_mean": sum(case["lens_cpu"]) / batch, "kernels": {}}
        for name, cfg in kernels.items():
            entry = {}
            try:
                entry["rel_err"] = rel_err(run(cfg, 0).cpu(), ref)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for layer in range(LAYERS):
                        run(cfg, layer)
                entry["us_per_call"] = min(replay_seconds(graph, 20) for _ in range(3)) / LAYERS * 1e6
                del graph
            except Exception as e:  # a config that does not fit is a row, not the end
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["kernels"][name] = entry
            print(f"{spec} (mean {row['lens_mean']:.0f} keys) {name:24s} "
                  f"{entry.get('us_per_call', float('nan')):7.2f} µs  err "
                  f"{entry.get('rel_err', float('nan')):.1e} {entry.get('error', '')}", flush=True)
        rows.append(row)
        case = None  # noqa: F841 (frees the KV buffers before the next case)
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
