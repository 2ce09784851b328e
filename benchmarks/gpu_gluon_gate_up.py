"""The one-row gate/up + SiLU: the Gluon kernel (TMA ring filled before its PDL wait,
rollout/layers/gluon_gate_up.py) against the Triton FMA kernel the engine runs, side by side in
one process, Qwen2-1.5B's shape (inter 8960, K 1536), bf16, weights rotating through copies
larger than L2. Two settings, each captured in one CUDA graph under the engine's decode PDL
policy, µs a call (median of rounds):
  * alone: gate/up calls back to back;
  * chain: o (one-row GEMV 1536 x 1536) -> RMSNorm -> gate/up, the MLP's entry in a decode
    layer, where the latency-bound o and norm leave HBM idle for gate/up's early weight loads.
The copy bandwidth measured in the same run gives the floor.

  python benchmarks/gpu_gluon_gate_up.py --out $OUT/gluon_gate_up.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.cuda_timing import replay_seconds

INTER, K = 8960, 1536
COPIES = 12  # 12 x 55 MB of gate/up weights: far past the 60 MB L2
CONFIGS = [(8, 2, 8, 2, 0), (4, 3, 4, 3, 0), (8, 1, 8, 4, 0), (4, 2, 4, 4, 0), (4, 1, 4, 8, 0),
           (16, 1, 16, 2, 0), (2, 2, 2, 8, 0), (8, 1, 8, 3, 0)]


def copy_bandwidth() -> float:
    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def capture(fn) -> torch.cuda.CUDAGraph:
    from rollout import pdl_policy
    with pdl_policy.decode_forward():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from rollout import pdl_policy
    from rollout.layers import gluon_gate_up, triton_gemv, triton_ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gu = [(torch.randn(2 * INTER, K, generator=gen, device="cuda") * K ** -0.5).bfloat16()
            for _ in range(COPIES)]
    w_o = [(torch.randn(K, K, generator=gen, device="cuda") * K ** -0.5).bfloat16()
           for _ in range(COPIES)]
    norm_w = torch.rand(K, device="cuda").bfloat16() + 0.5
    x = torch.randn(1, K, generator=gen, device="cuda").bfloat16()
    normed = torch.empty_like(x)
    out = torch.empty(1, INTER, dtype=torch.bfloat16, device="cuda")

    def gate_up_fn(name):
        if name == "triton":
            return lambda w: triton_gemv.skinny_gate_up_silu(normed, w, INTER)
        cfg = gluon_gate_up.GluonGateUpConfig(*name[:4], bool(name[4]))
        return lambda w: gluon_gate_up.gate_up_silu(normed, w, INTER, cfg, out=out)

    def alone(gu):
        def run():
            for w in w_gu:
                gu(w)
        return run

    def chain(gu):
        def run():
            for wo, w in zip(w_o, w_gu):
                with pdl_policy.preloaders_early():  # o triggers early, as in the engine
                    o = triton_gemv.skinny_linear(x, wo, None)
                triton_ops.rms_norm(o, norm_w, 1e-6, out=normed)
                gu(w)
        return run

    results = {"copy_bandwidth_GBps": copy_bandwidth() / 1e9, "alone": {}, "chain": {}}
    names = ["triton"] + CONFIGS
    ref = None
    for name in names:  # correctness first: each kernel's output on copy 0 vs the Triton one
        normed.copy_(x)
        y = gate_up_fn(name)(w_gu[0]).clone()
        ref = y if ref is None else ref
        ok = torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-3)
        print(f"check {name}: {'ok' if ok else 'MISMATCH'}", flush=True)
    graphs = {(kind, str(n)): capture((alone if kind == "alone" else chain)(gate_up_fn(n)))
              for kind in ("alone", "chain") for n in names}
    samples = {key: [] for key in graphs}
    for _ in range(args.rounds):
        for key, graph in graphs.items():
            samples[key].append(replay_seconds(graph, args.replays) / COPIES * 1e6)
    floor = 2 * INTER * K * 2 / (results["copy_bandwidth_GBps"] * 1e9) * 1e6
    for (kind, name), vals in samples.items():
        results[kind][name] = {"us_per_call": statistics.median(vals), "rounds": vals}
        print(f"{kind:6s} {name:22s} {statistics.median(vals):7.2f} µs  (rounds "
              f"{', '.join(f'{v:.2f}' for v in vals)})", flush=True)
    results["gate_up_floor_us"] = floor
    print(f"copy bandwidth {results['copy_bandwidth_GBps']:.0f} GB/s; gate/up weights at it "
          f"{floor:.2f} µs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
