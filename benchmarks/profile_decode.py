"""Where a decode step's time goes (GPU): graph replay alone vs the whole step, and the top
CPU/CUDA ops of a generate call under torch.profiler.

  python benchmarks/profile_decode.py --shape qwen2-1.5b --batch-sizes 1 128 --out $OUT/profile.txt
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_throughput import SHAPES, prompts_for
from rollout import Engine, EngineConfig, SamplingParams
from rollout.tiny_model import make_tiny_model


def replay_ms(engine: Engine, bs: int, n: int = 50) -> float:
    gr = engine.runner.graph_runner
    if gr is None or bs not in gr.graphs:
        return float("nan")
    g = gr.graphs[bs]
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default="profile.txt")
    args = p.parse_args()
    spec = SHAPES[args.shape]
    d = make_tiny_model(Path(tempfile.mkdtemp()) / "m", spec, with_tokenizer=False)
    engine = Engine(EngineConfig(model_path=str(d), device="cuda", dtype="bfloat16",
                                 max_running_requests=max(args.batch_sizes)))
    lines = []
    for bs in args.batch_sizes:
        prompts = prompts_for(bs, 128, spec.vocab_size)
        sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, seed=1)
        engine.generate(prompts, sp)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, sp)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        lines.append(f"bs={bs}: generate {wall * 1e3:.1f} ms for {args.new_tokens} tokens "
                     f"({wall / args.new_tokens * 1e3:.2f} ms/step); graph replay alone "
                     f"{replay_ms(engine, bs):.3f} ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, sp)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        lines.append(ka.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
        print(lines[-3], flush=True)
    Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
