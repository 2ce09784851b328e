"""Why the batch-1 decode graph replays slower in the decode benchmark's process (engine beside
HF `generate`, 1.022-1.027 ms) than in a process of the engine alone (1.003-1.009 ms).

One process, the decode benchmark's engine (sized for 128 requests), the batch-1 graph timed by
`replay_seconds` (50 replays) through a sequence of states: engine alone, right after an HF
`generate` call, then after one action each (gc, empty_cache, an HF forward, engine generates
of 1, 2 and 8 tokens, HF generates of 1, 2 and 8 tokens): which action makes the step slow and
which makes it fast again. In the fast and the slow state also the per-kernel GPU times
(torch.profiler, 5 replays) and the host time of a replay's launch. `nvidia-smi` samples SM and
memory clocks and power every 20 ms beside it (the first run: 1,980 / 3,201 MHz throughout).

  python benchmarks/process_shape.py --out $OUT/process_shape.json --smi-log $OUT/smi.csv
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time
from pathlib import Path

import torch

from benchmarks.cuda_timing import full_batch_graph, replay_seconds
from rollout import SamplingParams
from benchmarks.decode_throughput import (_load_hf, engine_runner, gpu_engine, hf_runner,
                                          model_dir_for)

T0 = time.time()


def stamp() -> float:
    return round(time.time() - T0, 3)


def timings(graph, label: str, times: int, log: list) -> None:
    for i in range(times):
        t = stamp()
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        ms = replay_seconds(graph, 50) * 1e3
        log.append({"state": label, "i": i, "t": t, "replay_ms": round(ms, 4),
                    "host_loop_ms": round((time.perf_counter() - h0) * 1e3, 2)})
        print(json.dumps(log[-1]), flush=True)


def launch_host_us(graph, replays: int = 50) -> float:
    """Host time of one replay's launch, the GPU kept busy ahead of it (a 1 GB copy queued
    first), so the launches never wait for the GPU."""
    a = torch.empty(1 << 28, device="cuda")
    b = torch.empty_like(a)
    torch.cuda.synchronize()
    for _ in range(20):
        b.copy_(a)
    h0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    us = (time.perf_counter() - h0) / replays * 1e6
    torch.cuda.synchronize()
    return us


def kernel_times(graph, label: str, log: list, replays: int = 5) -> None:
    from benchmarks.graph_kernel_profile import kernel_table
    rows = kernel_table(graph, replays)
    log.append({"state": label, "kernels": [dict(r, us_per_replay=round(r["us_per_replay"], 2))
                                            for r in rows[:40]],
                "total_us": round(sum(r["us_per_replay"] for r in rows), 1)})
    print(json.dumps({"state": label, "total_us": log[-1]["total_us"]}), flush=True)


def timed_call(call, label: str, log: list) -> None:
    t = stamp()
    tokens, seconds = call()
    log.append({"state": label, "t": t, "call_s": round(seconds, 5),
                "tok_per_s": round(tokens / seconds, 1)})
    print(json.dumps(log[-1]), flush=True)


def probe(graph, label: str, action, log: list) -> None:
    """Runs `action`, then times the graph: which action brings the fast step back?"""
    action()
    torch.cuda.synchronize()
    timings(graph, label, 1, log)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smi-log", default=None)
    p.add_argument("--max-running", type=int, default=128)
    args = p.parse_args()
    smi = None
    if args.smi_log:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,pstate,"
             "utilization.gpu,temperature.gpu,clocks_event_reasons.active",
             "--format=csv", "-lms", "20"], stdout=open(args.smi_log, "w"))
    log: list = [{"t0_unix": T0}]
    run_args = argparse.Namespace(new_tokens=128, prompt_len=128, device="cuda", dtype="bfloat16",
                                  hf_static_cache=False)
    engine = gpu_engine("qwen2-1.5b", args.max_running)
    engine_call = engine_runner(engine, 1, run_args)
    timed_call(engine_call, "engine call, engine alone", log)
    graph = full_batch_graph(engine, 1, 256, required=True)
    timings(graph, "engine alone", 2, log)
    log.append({"state": "launch host us, fast", "us": round(launch_host_us(graph), 1)})
    kernel_times(graph, "kernels, fast", log)
    hf = _load_hf(model_dir_for("qwen2-1.5b"), run_args)
    hf_call = hf_runner(hf, 1, run_args)  # includes HF's 4-token warm-up
    timed_call(hf_call, "HF call", log)
    timings(graph, "right after HF call", 2, log)
    log.append({"state": "launch host us, after HF", "us": round(launch_host_us(graph), 1)})
    kernel_times(graph, "kernels, after HF", log)
    timings(graph, "after the profile", 1, log)
    probe(graph, "after gc.collect", gc.collect, log)
    probe(graph, "after empty_cache", torch.cuda.empty_cache, log)
    ids = torch.randint(0, 256, (1, 128), device="cuda")
    probe(graph, "after an HF forward", lambda: hf(ids), log)
    probe(graph, "after the engine's 1-token generate",
          lambda: engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1)), log)
    probe(graph, "after the engine's 2-token generate",
          lambda: engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2)), log)
    probe(graph, "after the engine's 8-token generate",
          lambda: engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8)), log)
    hf_call()
    timings(graph, "after a second HF call", 1, log)
    probe(graph, "after an HF forward (2)", lambda: hf(ids), log)
    probe(graph, "after HF generate of 1 token",
          lambda: hf.generate(ids, max_new_tokens=1, do_sample=True, pad_token_id=0), log)
    probe(graph, "after the engine's 8-token generate (2)",
          lambda: engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8)), log)
    probe(graph, "after HF generate of 2 tokens",
          lambda: hf.generate(ids, max_new_tokens=2, do_sample=True, pad_token_id=0), log)
    probe(graph, "after HF generate of 8 tokens",
          lambda: hf.generate(ids, max_new_tokens=8, do_sample=True, pad_token_id=0), log)
    probe(graph, "after HF greedy generate of 8 tokens",
          lambda: hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), log)
    if smi is not None:
        smi.terminate()
    Path(args.out).write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
