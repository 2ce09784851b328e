"""Probe: does launching the batch-1 decode graph block the host, and does alternating two
captured copies of it (double-buffered graph execs) change that or the engine's tok/s?

  python benchmarks/gpu_launch_probe.py --out $OUT/launch_probe.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.decode_throughput import SHAPES, model_dir_for, prompts_for
from rollout import Engine, EngineConfig, SamplingParams


def host_ms_per_launch(graphs, n: int = 60) -> tuple[float, float]:
    """(median host ms inside replay(), wall ms per replay) for n back-to-back replays."""
    torch.cuda.synchronize()
    host, t0 = [], time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        graphs[i % len(graphs)].replay()
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(host) * 1e3, (time.perf_counter() - t0) / n * 1e3


def tok_per_s(engine: Engine, prompts, sp) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="launch_probe.json")
    args = p.parse_args()
    d = model_dir_for("qwen2-1.5b")
    engine = Engine(EngineConfig(model_path=str(d), device="cuda", dtype="bfloat16",
                                 max_running_requests=8, load_format="dummy"))
    gr = engine.runner.graph_runner
    with torch.inference_mode():
        g2, out2 = gr._capture_one(1, 1, torch.cuda.graph_pool_handle())
    g1, out1 = gr.graphs[1, 0], gr.outputs[1, 0]  # batch 1, short contexts
    result = {"one_exec": host_ms_per_launch([g1]), "two_execs": host_ms_per_launch([g1, g2])}
    print(result, flush=True)
    prompts = prompts_for(1, 128, SHAPES["qwen2-1.5b"].vocab_size)
    sp = SamplingParams(max_new_tokens=128, temperature=1.0, ignore_eos=True, seed=1)
    replay, flip = gr.replay, [0]

    def alternating(fb):
        flip[0] ^= 1
        gr.graphs[1, 0], gr.outputs[1, 0] = (g2, out2) if flip[0] else (g1, out1)
        return replay(fb)
    engine.generate(prompts, sp)
    rates = {"one_exec": [], "two_execs": []}
    for _ in range(3):
        gr.replay = replay
        gr.graphs[1, 0], gr.outputs[1, 0] = g1, out1
        rates["one_exec"].append(tok_per_s(engine, prompts, sp))
        gr.replay = alternating
        rates["two_execs"].append(tok_per_s(engine, prompts, sp))
    result["tok_per_s_batch1"] = rates
    print(json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
