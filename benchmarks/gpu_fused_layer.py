"""The batch-1 fused decode layer (rollout/layers/fused_layer) alone on the GPU: 28 Qwen2-1.5B
layers of random bf16 weights, one request of `--seq-len` keys, the 28 launches in one CUDA graph,
for one launch config; next to the copy bandwidth measured in the same process (the floor: the
layers' weight bytes at that bandwidth). One config a process, so that a config whose grid cannot
be resident fails alone (the launcher refuses it) and a hang is cut by the caller's timeout.

  python benchmarks/gpu_fused_layer.py --config programs_per_sm=2,num_warps=4 --out $OUT/f.jsonl

Appends one JSON line: the config, µs per layer (median of `--reps` replays of the graph),
GB/s of weights, the floor, and the output's relative difference from the first config's
(`--reference`, written when absent).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rollout.layers import fused_layer
from rollout.layers.fused_layer import FusedDecodeLayers, FusedLayerConfig, LayerShape
from rollout.layers.rotary import RotaryEmbedding

SHAPE = LayerShape(hidden=1536, heads=12, kv_heads=2, head_dim=128, inter=8960)
LAYERS = 28
SLOTS = 4096


def weight_bytes(s: LayerShape) -> int:
    return 2 * (s.qkv_rows * s.hidden + s.heads * s.head_dim * s.hidden + 3 * s.inter * s.hidden)


def build(seq_len: int, gen: torch.Generator):
    dev, dt = torch.device("cuda"), torch.bfloat16
    s = SHAPE

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt)
    layers = [(1 + rnd(s.hidden), rnd(s.qkv_rows, s.hidden), rnd(s.qkv_rows),
               rnd(s.hidden, s.heads * s.head_dim), 1 + rnd(s.hidden), rnd(2 * s.inter, s.hidden),
               rnd(s.hidden, s.inter)) for _ in range(LAYERS)]
    kv = [(rnd(SLOTS, s.kv_heads, s.head_dim, scale=1.0), rnd(SLOTS, s.kv_heads, s.head_dim, scale=1.0))
          for _ in range(LAYERS)]
    req_to_token = torch.randperm(SLOTS, generator=gen, device=dev)[:seq_len].to(torch.int32)[None]
    loc = req_to_token[0, seq_len - 1:].long()
    rope = RotaryEmbedding(s.head_dim, 4096, 1e6).to(dev).lookup(
        torch.tensor([seq_len - 1], device=dev), dt)
    meta = (loc, req_to_token, torch.zeros(1, dtype=torch.long, device=dev),
            torch.tensor([seq_len], device=dev))
    return layers, kv, rope, meta, rnd(1, s.hidden, scale=1.0)


def copy_bandwidth() -> float:
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="", help="FusedLayerConfig.parse spec ('' = default)")
    p.add_argument("--seq-len", type=int, default=200)
    p.add_argument("--last-phase", type=int, default=fused_layer.PHASES - 1,
                   help="stop each layer after this phase (0 qkv, 1 attention, 2 o, 3 gate/up): "
                        "the phases' cumulative cost")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--reference", default="/tmp/fused_layer_reference.pt")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = FusedLayerConfig.parse(args.config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, kv, rope, (loc, r2t, rows, lens), h0 = build(args.seq_len, gen)
    owner = FusedDecodeLayers(SHAPE, 1e-6, LAYERS, config)
    s = owner.scratch_for(h0)

    def step():
        s.counters.zero_()
        for i in range(LAYERS):
            fused_layer.launch_layer(owner, s, layers[i], h0 if i == 0 else s.h, i > 0, i, rope,
                                     kv[i][0], kv[i][1], loc, r2t, rows, lens, SHAPE.head_dim ** -0.5,
                                     last_phase=args.last_phase)
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    out = torch.cat((s.h, s.residual), 1).float()
    ref_path = Path(args.reference)
    if args.last_phase != fused_layer.PHASES - 1:
        diff = None
    elif ref_path.exists():
        ref = torch.load(ref_path)
        diff = ((out.cpu() - ref).norm() / ref.norm()).item()
    else:
        torch.save(out.cpu(), ref_path)
        diff = 0.0
    step_us = sorted(times)[len(times) // 2]
    bw = copy_bandwidth()
    nbytes = LAYERS * weight_bytes(SHAPE)
    row = dict(config=config.__dict__, last_phase=args.last_phase, programs=owner.programs(h0.device), seq_len=args.seq_len,
               step_us=round(step_us, 1), us_per_layer=round(step_us / LAYERS, 2),
               weight_gb_per_s=round(nbytes / step_us / 1e3, 1), copy_gb_per_s=round(bw, 1),
               floor_us_per_layer=round(nbytes / bw / 1e3 / LAYERS, 2),
               first_call_s=round(first_s, 1), rel_diff_vs_reference=diff,
               n_regs=owner.compiled.n_regs, shared_bytes=owner.compiled.metadata.shared,
               cp_async="cp.async" in owner.compiled.asm["ptx"])
    print(json.dumps(row))
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
