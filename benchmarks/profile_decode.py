"""Where a decode step's time goes.

GPU: graph replay alone vs the whole step, and the top CPU/CUDA ops of a generate call under
torch.profiler.
CPU: the step split into its parts (model forward without the LM head, LM head, sampler, batch
building, attention metadata, the rest: scheduler and engine), timed by wrapping each part, and
the top ops under torch.profiler.

  python benchmarks/profile_decode.py --shape qwen2-1.5b --batch-sizes 1 128 --out $OUT/profile.txt
  python benchmarks/profile_decode.py --device cpu --shape cpu-small --batch-sizes 1 64
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.call_breakdown import call_seconds
from benchmarks.cuda_timing import generate_seconds, replay_seconds
from benchmarks.decode_throughput import SHAPES, model_dir_for, prompts_for
from rollout import Engine, EngineConfig, SamplingParams


def replay_ms(engine: Engine, bs: int, n: int = 50) -> float:
    gr = engine.runner.graph_runner
    if gr is None or (bs, 0) not in gr.graphs:
        return float("nan")
    return replay_seconds(gr.graphs[(bs, 0)], n) * 1e3  # launch class 0: short contexts


def host_busy_ms(engine: Engine, prompts, sp: SamplingParams) -> tuple[float, float]:
    """GPU: (wall ms per step, ms per step the host spent outside the wait for sampled tokens).
    When the second is close to the first, the host sets the pace, not the GPU."""
    import rollout.launched_step as ls
    waited, wait = [0.0], ls.LaunchedStep.wait

    def timed(self):
        t0 = time.perf_counter()
        try:
            return wait(self)
        finally:
            waited[0] += time.perf_counter() - t0
    ls.LaunchedStep.wait = timed
    try:
        steps0 = engine.stats.steps
        wall = generate_seconds(engine, prompts, sp)
    finally:
        ls.LaunchedStep.wait = wait
    steps = engine.stats.steps - steps0
    return wall / steps * 1e3, (wall - waited[0]) / steps * 1e3


# generate with one new token: the batch's prefill and first sampled token alone
PREFILL_ONLY = SamplingParams(max_new_tokens=1, ignore_eos=True, seed=1, temperature=1.0)


def prefill_ms(engine: Engine, prompts, n: int = 3) -> float:
    """Median of n `PREFILL_ONLY` calls: what a generate call spends before its first decode step."""
    return sorted(call_seconds(engine, prompts, PREFILL_ONLY.max_new_tokens, n))[n // 2] * 1e3


def cpu_sections(engine: Engine, prompts, sp: SamplingParams, repeats: int = 5) -> list[str]:
    """Per-step microseconds of each part of the step, from wrappers around them (CPU only:
    the wrappers time host work, which on CPU is all the work)."""
    import rollout.scheduler as scheduler_mod
    runner, acc = engine.runner, collections.Counter()

    def wrap(obj, name, label):
        f = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0
        setattr(obj, name, timed)
        return lambda: setattr(obj, name, f)

    undo = [wrap(runner.attn_backend, "init_forward_metadata", "attention metadata"),
            wrap(runner.model.model, "forward", "model forward (no LM head)"),
            wrap(runner.model, "compute_logits", "LM head (logits)"),
            wrap(runner, "sample", "sampler"),
            wrap(scheduler_mod, "build_batch", "batch building (ForwardBatch)"),
            wrap(scheduler_mod, "build_decode_batch", "batch building (ForwardBatch)")]
    engine.generate(prompts, sp)
    acc.clear()
    steps0 = engine.stats.steps
    t0 = time.perf_counter()
    for _ in range(repeats):
        engine.generate(prompts, sp)
    wall = time.perf_counter() - t0
    for u in undo:
        u()
    steps = engine.stats.steps - steps0
    per = {k: v / steps * 1e6 for k, v in acc.items()}
    per["rest: scheduler, engine, KV table"] = wall / steps * 1e6 - sum(per.values())
    lines = [f"  {wall / steps * 1e6:7.0f} us per step ({steps // repeats} steps per generate, "
             f"prefill included)"]
    lines += [f"  {v:7.0f} us  {k}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])]
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=None, help="default: 128 on GPU, 32 on CPU")
    p.add_argument("--out", default="profile.txt")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    prompt_len = args.prompt_len or (128 if cuda else 32)
    spec = SHAPES[args.shape]
    d = model_dir_for(args.shape)
    engine = Engine(EngineConfig(model_path=str(d), device=args.device,
                                 dtype="bfloat16" if cuda else "float32",
                                 max_running_requests=max(args.batch_sizes),
                                 kv_cache_tokens=None if cuda else 65536,
                                 prefix_cache=False))  # repeated prompts: time them uncached
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lines = []
    for bs in args.batch_sizes:
        first = len(lines)
        prompts = prompts_for(bs, prompt_len, spec.vocab_size)
        sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=1,
                            temperature=1.0)
        engine.generate(prompts, sp)
        sync()
        t0 = time.perf_counter()
        engine.generate(prompts, sp)
        sync()
        wall = time.perf_counter() - t0
        head = (f"bs={bs}: generate {wall * 1e3:.1f} ms for {args.new_tokens} tokens "
                f"({wall / args.new_tokens * 1e3:.2f} ms/step)")
        if cuda:
            lines.append(f"{head}; graph replay alone {replay_ms(engine, bs):.3f} ms; "
                         f"prefill alone {prefill_ms(engine, prompts):.1f} ms")
            wall_ms, busy_ms = host_busy_ms(engine, prompts, sp)
            lines.append(f"  per step: wall {wall_ms:.3f} ms, host busy (not waiting for tokens) "
                         f"{busy_ms:.3f} ms")
        else:
            lines.append(head)
            lines += cpu_sections(engine, prompts, sp)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            engine.generate(prompts, sp)
            sync()
        ka = prof.key_averages()
        lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        if cuda:
            lines.append(ka.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
            lines.append(f"bs={bs}: the prefill alone (generate with one new token) under the profiler")
            with profile(activities=activities) as prof:
                engine.generate(prompts, PREFILL_ONLY)
                sync()
            ka = prof.key_averages()
            lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
            lines.append(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        print("\n".join(lines[first:]), flush=True)
    Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
