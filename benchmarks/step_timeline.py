"""Where a generate call's wall time goes on the GPU's timeline: the decode benchmark's call (prompt
128, 128 new tokens, sampling) under torch.profiler, its kernels and copies laid on one time
axis with the call's own range.

The decode graph's replay time alone (decode_throughput's `graph_replay_ms`) times 127 steps
leaves several ms of a batch-1 call unexplained; this splits the call into: the host's lead
before the first GPU work, the prefill (up to the first sampled token), the decode steps (each
ending with the sampler's last kernel), the GPU's idle gaps inside them (and the kernels on both
sides of the largest), the GPU time outside the decode graph's kernels (sampler, copies), and
the tail after the last GPU work; and the prefill's kernels by name. Twice: with the host's
events (the call's range; the profiler slows the host, so host-bound gaps grow) and with the
GPU's alone (no host range: the window is the GPU work).

  python benchmarks/step_timeline.py --batch-sizes 1 128 --out $OUT/timeline.json
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.decode_throughput import gpu_engine, prompts_for
from rollout import SamplingParams

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_END = "_pick"  # the sampler's last kernel: one per step (prefill's first token included)
SAMPLER = ("_chunk_stats", "_chunk_max", "_chunk_sum", "_pick")  # the sampler's kernels, then and now


def gpu_events(trace: dict) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, copy and memset, by start."""
    evs = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in trace["traceEvents"]
           if e.get("cat") in GPU_CATS]
    return sorted(evs)


def call_range(trace: dict, name: str) -> tuple[float, float] | None:
    """The call's range on the host (None in a GPU-only trace, which has no host events)."""
    ev = next((e for e in trace["traceEvents"] if e.get("name") == name and e.get("ph") == "X"
               and e.get("cat") == "user_annotation"), None)
    return (ev["ts"], ev["ts"] + ev["dur"]) if ev else None


def busy_and_gaps(evs, start: float, end: float):
    """GPU-busy µs (union of intervals) in [start, end] and the idle gaps: (µs, before, after)."""
    busy, gaps, cur_end, prev = 0.0, [], start, "window start"
    for s, e, n in evs:
        if e <= start or s >= end:
            continue
        s, e = max(s, start), min(e, end)
        if s > cur_end:
            gaps.append((s - cur_end, prev, n))
        if e > cur_end:
            busy += e - max(s, cur_end)
            cur_end, prev = e, n
    if end > cur_end:
        gaps.append((end - cur_end, prev, "call end"))
    return busy, gaps


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def by_name(evs, start: float, end: float, top: int = 10) -> dict:
    """ms by kernel/copy name inside [start, end] (under PDL a kernel's time includes its wait)."""
    acc = collections.Counter()
    for s, e, n in evs:
        if start <= s < end:
            acc[short(n)] += e - s
    return {k: round(v / 1e3, 4) for k, v in acc.most_common(top)}


def analyse(trace: dict, new_tokens: int) -> dict:
    evs = gpu_events(trace)
    host = call_range(trace, "generate_call")
    if host is None:  # GPU only: the call's GPU work is the whole trace
        t0, t1 = evs[0][0], max(e for _, e, _ in evs)
    else:
        t0, t1 = host
        evs = [ev for ev in evs if t0 <= ev[0] <= t1]
    picks = [e for s, e, n in evs if n.startswith(STEP_END)]
    first_gpu, last_gpu = evs[0][0], max(e for _, e, _ in evs)
    prefill_end = picks[0] if picks else last_gpu
    prefill_busy, prefill_gaps = busy_and_gaps(evs, first_gpu, prefill_end)
    steps = [b - a for a, b in zip(picks, picks[1:])]
    busy, gaps = busy_and_gaps(evs, first_gpu, last_gpu)
    _, decode_gaps = busy_and_gaps(evs, prefill_end, picks[-1] if picks else last_gpu)
    outside = collections.Counter()
    for s, e, n in evs:
        if s >= prefill_end and (n.startswith(SAMPLER) or not n.startswith(("triton", "_"))
                                 or "memcpy" in n.lower() or "memset" in n.lower()):
            outside[short(n)] += e - s
    gap_pairs = collections.Counter()
    for g, a, b in decode_gaps:
        gap_pairs[f"{short(a)} -> {short(b)}"] += g
    ms = lambda us: round(us / 1e3, 4)  # noqa: E731
    return {
        "call_ms": ms(t1 - t0) if host else None,
        "host_lead_ms": ms(first_gpu - t0) if host else None,
        "prefill_and_first_token_ms": ms(prefill_end - first_gpu),
        "prefill_gpu_busy_ms": ms(prefill_busy),
        "prefill_by_name_ms": by_name(evs, first_gpu, prefill_end),
        # the prefill window's idle gaps of 5 µs or more, in order: what the GPU waited for
        "prefill_gaps_us": [[round(g, 1), short(a), short(b)] for g, a, b in prefill_gaps if g >= 5],
        "decode_ms": ms((picks[-1] if picks else last_gpu) - prefill_end),
        "tail_ms": ms(t1 - (picks[-1] if picks else last_gpu)) if host else None,
        "steps": len(steps),
        "step_ms_median": ms(sorted(steps)[len(steps) // 2]) if steps else None,
        "step_ms_min": ms(min(steps)) if steps else None,
        "gpu_busy_ms": ms(busy),
        "decode_idle_ms": ms(sum(g for g, _, _ in decode_gaps)),
        "decode_idle_by_neighbours_ms": {k: ms(v) for k, v in gap_pairs.most_common(8)},
        "decode_outside_graph_kernels_ms": {k: ms(v) for k, v in outside.most_common(12)},
        "gpu_events": len(evs),
        "new_tokens": new_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default="timeline.json")
    args = p.parse_args()
    engine = gpu_engine(args.shape, max(args.batch_sizes))
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=1)
    result = {}
    for bs in args.batch_sizes:
        prompts = prompts_for(bs, args.prompt_len, engine.model_config.vocab_size)
        for _ in range(2):
            engine.generate(prompts, sp)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, sp)
        torch.cuda.synchronize()
        plain_ms = (time.perf_counter() - t) * 1e3
        row = {"call_ms_unprofiled": round(plain_ms, 3)}
        # with the host's events (the call's range; the profiler slows the host down), then the
        # GPU's alone (a host as fast as unprofiled, nearly: its gaps are the engine's own)
        for label, activities in (("with_host", [ProfilerActivity.CPU, ProfilerActivity.CUDA]),
                                  ("gpu_only", [ProfilerActivity.CUDA])):
            with profile(activities=activities) as prof:
                with record_function("generate_call"):
                    engine.generate(prompts, sp)
                    torch.cuda.synchronize()
            path = Path(tempfile.mkdtemp()) / "trace.json"
            prof.export_chrome_trace(str(path))
            row[label] = analyse(json.loads(path.read_text()), args.new_tokens)
        result[str(bs)] = row
        print(f"bs={bs}: " + json.dumps(row, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
