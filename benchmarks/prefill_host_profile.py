"""Where the host time of an eager (un-graphed) prefill goes, by Python function.

A batch-1 prefill on the GPU is host-bound (GPU work ~2 ms, wall 15-28 ms for the Qwen2-1.5B
shape): this times `generate` with one new token (the prefill alone) with CUDA events around
it (with the one-request prefill graph, then eager), then runs the eager one (`--graphed`: the
graphed one) under cProfile and prints the functions with the most own time.

  python benchmarks/prefill_host_profile.py --shape qwen2-1.5b --out $OUT/prefill_host.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time

import torch

from benchmarks.decode_throughput import SHAPES, prompts_for
from rollout import Engine, EngineConfig, SamplingParams
from rollout.tiny_model import make_tiny_model

PREFILL_ONLY = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True, seed=1)


def timed_ms(engine: Engine, prompts, n: int) -> tuple[float, float]:
    """Median wall ms and GPU ms (events on the current stream) of n prefill-only calls."""
    walls, gpus = [], []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        engine.generate(prompts, PREFILL_ONLY)
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        gpus.append(start.elapsed_time(end))
    return statistics.median(walls), statistics.median(gpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen2-1.5b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--out", default=None)
    p.add_argument("--graphed", action="store_true",
                   help="profile the calls through the prefill graph (default: eager)")
    args = p.parse_args()
    spec = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as d:
        make_tiny_model(d, spec, with_tokenizer=False)
        engine = Engine(EngineConfig(model_path=d, device="cuda", dtype="bfloat16",
                                     max_running_requests=max(args.batch, 8),
                                     prefix_cache=False))  # repeated prompts: time them uncached
        prompts = prompts_for(args.batch, args.prompt_len, spec.vocab_size)
        timed_ms(engine, prompts, 3)  # warm-up: Triton compiles, allocator
        graphs = engine.runner.graph_runner
        graphed = timed_ms(engine, prompts, args.calls) if graphs.prefill is not None else None
        if not args.graphed:
            graphs.prefill = None  # eager from here on: what the profile is about
            timed_ms(engine, prompts, 2)
        wall, gpu = timed_ms(engine, prompts, args.calls)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            engine.generate(prompts, PREFILL_ONLY)
        torch.cuda.synchronize()
        prof.disable()
    text = io.StringIO()
    kind = "graphed" if args.graphed else "eager"
    text.write(f"batch {args.batch} x {args.prompt_len} prompt tokens, prefill only, median of "
               f"{args.calls}: {kind} wall {wall:.2f} ms (stream time between events {gpu:.2f} ms)")
    if graphed is not None:
        text.write(f"; with the prefill graph: wall {graphed[0]:.2f} ms ({graphed[1]:.2f} ms)")
    text.write(f"\nThe {kind} prefill under cProfile:\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue()[:6000])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text.getvalue())


if __name__ == "__main__":
    main()
