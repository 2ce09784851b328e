"""Where a continuous-batching rollout's time goes, step by step: the staggered rollout of
`staggered_rollout.py` (more requests than run at once, ragged prompts and responses) with a
CUDA event pair around every step's device work and host timers around the scheduler's waits.

Per step kind (decode, and admission steps: prefill with or without running rows riding
along) it reports the steps, their rows and tokens, the GPU time between each step's events
(its kernels, and any gap inside it while the host was still launching them), and the GPU's idle
time before each step (the host had not queued it yet); for the call, the host's time blocked on
the device (overlap scheduling waits there when the GPU is the bottleneck) against the host's
own work. Then a GPU-only torch.profiler trace of one call gives the GPU time by kernel name,
and a cProfile of one call the host's functions. Engine alone, JSON out.

  python benchmarks/rollout_timeline.py --requests 512 --max-running 128 --out $OUT/tl.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.cuda_timing import generate_host_profile, generate_seconds
from benchmarks.decode_throughput import gpu_engine_config, model_dir_for
from benchmarks.staggered_rollout import workload, workload_options
from benchmarks.step_timeline import busy_and_gaps, by_name, gpu_events
from rollout import Engine
from rollout import launched_step


class StepClock:
    """CUDA events around each scheduler `_launch` (the step's device work, its input copies
    included) and what the step was; host seconds blocked in `LaunchedStep.wait`."""

    def __init__(self, engine: Engine):
        self.engine, self.steps, self.blocked = engine, [], 0.0
        sched = engine.scheduler
        launch, run = sched._launch, sched.run_batch
        self._last_fb = None

        def timed_run(fb):
            self._last_fb = fb
            return run(fb)

        def timed_launch(prev):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            replays = self._replays()
            t = time.perf_counter()
            start.record()
            out = launch(prev)
            end.record()
            if out is not None:
                self.steps.append(self._describe(start, end, time.perf_counter() - t, replays))
            return out

        sched._launch, sched.run_batch = timed_launch, timed_run
        wait = launched_step.LaunchedStep.wait

        def timed_wait(step):
            t = time.perf_counter()
            try:
                return wait(step)
            finally:
                self.blocked += time.perf_counter() - t

        launched_step.LaunchedStep.wait = timed_wait

    def _replays(self) -> tuple[int, int]:
        gr = self.engine.runner.graph_runner
        if gr is None:
            return 0, 0
        return (gr.prefill.num_replays if gr.prefill is not None else 0), gr.num_replays

    def _describe(self, start, end, host_s: float, replays_before) -> dict:
        fb = self._last_fb
        prefill_after, decode_after = self._replays()
        decode = fb.forward_mode.is_decode
        rows = fb.batch_size
        tokens = int(fb.input_ids.shape[0])
        kind = "decode" if decode else "admission"
        return {"kind": kind, "rows": rows, "tokens": tokens, "start": start, "end": end,
                "host_launch_s": host_s,
                "graph": (decode_after > replays_before[1]) if decode
                else (prefill_after > replays_before[0])}

    def reset(self) -> None:
        self.steps, self.blocked = [], 0.0

    def summary(self) -> dict:
        torch.cuda.synchronize()
        rows, prev_end = [], None
        for s in self.steps:
            gpu_ms = s["start"].elapsed_time(s["end"])
            idle_ms = prev_end.elapsed_time(s["start"]) if prev_end is not None else 0.0
            prev_end = s["end"]
            rows.append((s, gpu_ms, idle_ms))
        by_kind = {}
        for kind in ("decode", "admission"):
            sel = [(s, g, i) for s, g, i in rows if s["kind"] == kind]
            if not sel:
                continue
            gpu = [g for _, g, _ in sel]
            by_kind[kind] = {
                "steps": len(sel), "graph_steps": sum(s["graph"] for s, _, _ in sel),
                "rows": sum(s["rows"] for s, _, _ in sel),
                "tokens": sum(s["tokens"] for s, _, _ in sel),
                "gpu_ms": round(sum(gpu), 2), "gpu_ms_median": round(statistics.median(gpu), 4),
                "idle_before_ms": round(sum(i for _, _, i in sel), 2),
                "host_launch_ms": round(sum(s["host_launch_s"] for s, _, _ in sel) * 1e3, 2),
                "by_rows": _by_rows(sel)}
        return {"steps": len(rows), "host_blocked_ms": round(self.blocked * 1e3, 2),
                "by_kind": by_kind}


def _by_rows(sel) -> dict:
    """GPU ms a step by batch rows, bucketed (what a step costs as the batch shrinks)."""
    buckets = collections.defaultdict(list)
    for s, g, _ in sel:
        edge = 1
        while edge < s["rows"]:
            edge *= 2
        buckets[edge].append((g, s["tokens"]))
    return {f"<={k}": {"steps": len(v), "gpu_ms_median": round(statistics.median(g for g, _ in v), 4),
                       "tokens_median": statistics.median(t for _, t in v)}
            for k, v in sorted(buckets.items())}


def gpu_profile(engine: Engine, prompts, params) -> dict:
    """One call under a GPU-only trace: busy and idle time, kernels by name, idle gaps."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    evs = gpu_events(json.loads(path.read_text()))
    t0, t1 = evs[0][0], max(e for _, e, _ in evs)
    busy, gaps = busy_and_gaps(evs, t0, t1)
    pairs = collections.Counter()
    for g, a, b in gaps:
        pairs[f"{a[:50]} -> {b[:50]}"] += g
    return {"window_ms": round((t1 - t0) / 1e3, 2), "busy_ms": round(busy / 1e3, 2),
            "idle_ms": round(sum(g for g, _, _ in gaps) / 1e3, 2),
            "idle_by_neighbours_ms": {k: round(v / 1e3, 2) for k, v in pairs.most_common(10)},
            "kernels_ms": by_name(evs, t0, t1 + 1, top=30)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_options(p)
    p.add_argument("--skip-profiles", action="store_true", help="the step clock only")
    p.add_argument("--out", default="rollout_timeline.json")
    args = p.parse_args()
    overrides = {"mixed_steps": False} if args.no_mixed_steps else {}
    engine = Engine(gpu_engine_config(model_dir_for(args.shape), args.max_running, **overrides))
    prompts, params = workload(args, engine.model_config.vocab_size)
    generated = sum(sp.max_new_tokens for sp in params)
    generate_seconds(engine, prompts[:args.max_running], params[:args.max_running])  # warm-up
    plain = [generate_seconds(engine, prompts, params) for _ in range(2)]
    clock = StepClock(engine)
    timed = generate_seconds(engine, prompts, params)
    result = {"args": vars(args), "generated_tokens": generated,
              "prompt_tokens": sum(map(len, prompts)),
              "call_s_unclocked": [round(s, 4) for s in plain],
              "tok_per_s_unclocked": round(generated / min(plain), 1),
              "call_s_clocked": round(timed, 4), "steps": clock.summary()}
    print(json.dumps(result, indent=1), flush=True)
    if not args.skip_profiles:
        result["gpu_profile"] = gpu_profile(engine, prompts, params)
        print(json.dumps(result["gpu_profile"], indent=1), flush=True)
        result["host_profile"] = generate_host_profile(engine, prompts, params, top=35)
        print(result["host_profile"], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
