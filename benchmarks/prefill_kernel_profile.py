"""Where a batch prefill's time goes: `generate` with one new token for BATCH prompts of
PROMPT_LEN tokens (the decode benchmark's batch-128 prefill: 16,384 tokens in chunks of the
prefill budget), its wall time over a few calls, and torch.profiler's GPU time per kernel name
over one call, next to the GEMMs' share and their TFLOP/s.

  python benchmarks/prefill_kernel_profile.py --batch 128 --out $OUT/prefill_kernels.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.decode_throughput import SHAPES, gpu_engine, prompts_for
from benchmarks.graph_kernel_profile import cuda_kernel_rows
from rollout import Engine, SamplingParams

GEMM_NAMES = ("gemm", "sm90_xmma", "cutlass", "nvjet", "_gemm_tma_kernel", "_gemv_dot_kernel")


def idle_gaps(prof, top: int = 12) -> dict:
    """When the GPU sat idle inside the profiled call: before its first kernel, between kernels
    (the longest gaps, with the kernels around them) and after its last one, in ms."""
    call = [e for e in prof.events() if e.name == "generate_call"
            and e.device_type == torch.autograd.DeviceType.CPU]
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA
                     and e.name != "generate_call")  # the annotation's range on the GPU
    if not call or not kernels:
        return {}
    start, end = call[0].time_range.start, call[0].time_range.end
    gaps, busy_until, prev = [], kernels[0][1], kernels[0][2]
    for k_start, k_end, name in kernels[1:]:
        if k_start > busy_until:
            gaps.append(((k_start - busy_until) / 1e3, prev[:60], name[:60]))
        if k_end > busy_until:
            busy_until, prev = k_end, name
    gaps.sort(reverse=True)
    return {"call_ms": (end - start) / 1e3, "before_first_kernel_ms": (kernels[0][0] - start) / 1e3,
            "after_last_kernel_ms": (end - busy_until) / 1e3,
            "idle_between_kernels_ms": sum(g[0] for g in gaps), "gaps_over_20us": sum(g[0] > 0.02 for g in gaps),
            "longest_gaps": [{"ms": g[0], "after": g[1], "before": g[2]} for g in gaps[:top]]}


def host_until_first_forward(engine: Engine, prompts, sp: SamplingParams) -> float:
    """Host ms from the `generate` call to its first model forward (no profiler): requests,
    admission, the first batch and its metadata."""
    runner, first = engine.runner, []
    forward = runner.forward

    def timed(*a, **k):
        if not first:
            first.append(time.perf_counter())
        return forward(*a, **k)
    runner.forward = timed
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, sp)
    finally:
        del runner.forward
    return (first[0] - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    spec = SHAPES[args.shape]
    engine = gpu_engine(args.shape, args.batch)
    prompts = prompts_for(args.batch, args.prompt_len, spec.vocab_size)
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True, seed=1)
    engine.generate(prompts, sp)  # compile and warm up at this size
    walls = []
    for _ in range(args.calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, sp)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    host_ms = host_until_first_forward(engine, prompts, sp)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("generate_call"):
            engine.generate(prompts, sp)
            torch.cuda.synchronize()
    rows = [r for r in cuda_kernel_rows(prof, 1) if r["kernel"] != "generate_call"]
    gaps = idle_gaps(prof)
    total = sum(r["us_per_replay"] for r in rows)
    gemm = sum(r["us_per_replay"] for r in rows
               if any(n in r["kernel"] for n in GEMM_NAMES))
    tokens = args.batch * args.prompt_len
    layer_params = 0
    for name, t in engine.runner.model.named_parameters():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            layer_params += t.numel()
    flops = 2 * layer_params * tokens
    result = {"device": torch.cuda.get_device_name(), "batch": args.batch,
              "prompt_len": args.prompt_len, "wall_ms": [w * 1e3 for w in walls],
              "wall_ms_median": statistics.median(walls) * 1e3, "kernel_ms": total / 1e3,
              "gemm_ms": gemm / 1e3, "gemm_tflops": flops / (gemm * 1e-6) / 1e12 if gemm else None,
              "layer_matmul_flops": flops, "host_until_first_forward_ms": host_ms, "idle": gaps, "kernels": rows}
    print(f"batch {args.batch} x {args.prompt_len} tokens: wall {result['wall_ms_median']:.1f} ms "
          f"(calls {', '.join(f'{w * 1e3:.1f}' for w in walls)}), GPU kernels {total / 1e3:.1f} ms, "
          f"GEMMs {gemm / 1e3:.1f} ms ({result['gemm_tflops'] or 0:.0f} TFLOP/s of layer matmuls)")
    print(f"host until the first forward: {host_ms:.2f} ms")
    print("GPU idle in the profiled call:", json.dumps({k: v for k, v in gaps.items()
                                                         if k != "longest_gaps"}))
    for g in gaps.get("longest_gaps", []):
        print(f"  idle {g['ms']:7.3f} ms  after {g['after']}  before {g['before']}")
    for r in rows[:25]:
        print(f"  {r['us_per_replay'] / 1e3:8.2f} ms  {r['launches_per_replay']:5.0f}x  {r['kernel'][:100]}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
