"""Where a decode CUDA graph's time goes, kernel by kernel: torch.profiler over REPLAYS replays of
the engine's captured decode graph per batch size, each kernel's GPU time per replay (and how
many launches a replay has), next to the replay's wall time.

Run it with ROLLOUT_PDL=0: under programmatic dependent launch a kernel's measured duration
includes the time its blocks wait for the previous kernel, so the per-kernel split only adds up
without it (the replay time with PDL is what decode_throughput.py reports).

  ROLLOUT_PDL=0 python benchmarks/graph_kernel_profile.py --batch-sizes 1 128 --out $OUT/kernels.json
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.cuda_timing import full_batch_graph, replay_seconds
from benchmarks.decode_throughput import SHAPES, gpu_engine, prompts_for
from rollout import SamplingParams


def kernel_table(graph, replays: int) -> tuple[list[dict], list[dict]]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return cuda_kernel_rows(prof, replays), kernel_sequence(prof, replays)


def kernel_sequence(prof, replays: int) -> list[dict]:
    """A replay's kernels in launch order, each position's GPU time averaged over the replays:
    the per-op split that `cuda_kernel_rows` lumps by kernel name (e.g. the one-row GEMV
    kernel serving o, gate/up, down and the LM head)."""
    events = sorted((e for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events or len(events) % replays:
        return []
    per = len(events) // replays
    return [{"kernel": events[i].name[:80],
             "us": sum(events[r * per + i].time_range.elapsed_us() for r in range(replays)) / replays}
            for i in range(per)]


def cuda_kernel_rows(prof, replays: int) -> list[dict]:
    """Each CUDA kernel's GPU time and launches per replay, the longest first."""
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") \
                else e.cuda_time_total
            per[e.name][1] += 1
    rows = [{"kernel": k, "us_per_replay": t / replays, "launches_per_replay": n / replays}
            for k, (t, n) in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_replay"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    spec = SHAPES[args.shape]
    engine = gpu_engine(args.shape, max(args.batch_sizes))
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "batches": {}}
    for bs in args.batch_sizes:
        sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=1)
        engine.generate(prompts_for(bs, args.prompt_len, spec.vocab_size), sp)  # contexts ~192
        graph = full_batch_graph(engine, bs, args.prompt_len + args.new_tokens, required=True)
        replay_ms = replay_seconds(graph, 50) * 1e3
        rows, sequence = kernel_table(graph, args.replays)
        total = sum(r["us_per_replay"] for r in rows)
        result["batches"][bs] = {"replay_ms": replay_ms, "kernel_us_sum": total, "kernels": rows,
                                 "sequence": sequence}
        print(f"bs={bs}: replay {replay_ms:.3f} ms, kernels sum {total / 1e3:.3f} ms, "
              f"{sum(r['launches_per_replay'] for r in rows):.0f} launches a replay")
        for r in rows[:18]:
            print(f"  {r['us_per_replay']:8.1f} µs  {r['launches_per_replay']:5.0f}x  {r['kernel'][:90]}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
