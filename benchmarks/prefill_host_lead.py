"""Is the batch prefill bound by the host? For `generate` with one new token on BATCH prompts
(the decode benchmark's batch-128 prefill: two eager chunks of 8,192 tokens), each eager forward
is timed twice, unprofiled: on the host (the call's return: every kernel launched) and on the
GPU (CUDA events around it on the compute stream). A forward whose host time is close to its GPU
span had the GPU waiting on the host's launches; one far shorter had the host ahead. Beside them
the call's wall time, the host time before the first forward and after the last, and (profiled
separately, `prefill_kernel_profile.py`) the kernels' own time.

  python benchmarks/prefill_host_lead.py --batch 128 --out $OUT/prefill_host_lead.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cuda_timing import generate_host_profile, generate_seconds
from benchmarks.decode_throughput import gpu_engine, prompts_for
from rollout import SamplingParams


def timed_call(engine, prompts, sp) -> dict:
    runner = engine.runner
    forward = runner.forward_eager
    marks = []

    def timed(fb):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        out = forward(fb)
        end.record()
        marks.append((t0, time.perf_counter(), start, end, fb.num_tokens))
        return out
    runner.forward_eager = timed
    t0 = time.perf_counter()
    try:
        wall = generate_seconds(engine, prompts, sp)
    finally:
        del runner.forward_eager
    forwards = [{"tokens": n, "host_ms": (h1 - h0) * 1e3, "gpu_ms": s.elapsed_time(e)}
                for h0, h1, s, e, n in marks]
    return {"wall_ms": wall * 1e3, "forwards": forwards,
            "host_before_first_ms": (marks[0][0] - t0) * 1e3 if marks else None,
            "gpu_first_to_last_ms": marks[0][2].elapsed_time(marks[-1][3]) if marks else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--cprofile", type=int, default=0, help="then one call under cProfile: top N")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine = gpu_engine(args.shape, args.batch)
    prompts = prompts_for(args.batch, args.prompt_len, engine.model_config.vocab_size)
    sp = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True, seed=1)
    engine.generate(prompts, sp)  # compiles and allocations out of the way
    calls = [timed_call(engine, prompts, sp) for _ in range(args.calls)]
    for c in calls:
        fw = "; ".join(f"{f['tokens']} tokens host {f['host_ms']:.2f} / GPU {f['gpu_ms']:.2f} ms"
                       for f in c["forwards"])
        print(f"wall {c['wall_ms']:.2f} ms, host before the first forward "
              f"{c['host_before_first_ms']:.2f} ms, GPU first..last forward "
              f"{c['gpu_first_to_last_ms']:.2f} ms | {fw}")
    print(f"median wall {statistics.median(c['wall_ms'] for c in calls):.2f} ms")
    if args.cprofile:  # where the host's time goes in the forwards
        print(generate_host_profile(engine, prompts, sp, args.cprofile))
    Path(args.out).write_text(json.dumps({"batch": args.batch, "prompt_len": args.prompt_len,
                                          "calls": calls}, indent=1))


if __name__ == "__main__":
    main()
