"""Engine start-up with a cold Triton cache: the graphs' kernels compiled ahead in threads
(`EngineConfig.compile_workers`) against one at a time (0), side by side in one run.

Each start-up is its own process with an empty Triton cache (as on a fresh machine): the
decode benchmark's engine (Qwen2-1.5B shape, bf16, sized for 128 requests), timed from the
`Engine(...)` call to its return (load + compiles + graph capture), then its first `generate`
(one request, 4 tokens; the kernels outside the graphs, e.g. the sampler's, are compiled ahead
too since the twenty-sixth session: `first_generate_compiles` counts what still compiles there),
then the first `generate` of several requests of each kind a rollout starts with (eager
multi-request prefills: 3 and 8 ragged prompts, then 128 prompts of 128 tokens;
`first_batches`: their seconds and what each compiled, by kernel).
Variants alternate round by round; a last process per variant starts again on its warm cache.

  python benchmarks/startup_time.py --workers 0 16 --rounds 2 --out $OUT/startup.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def watch_compiles() -> dict:
    """Counts Triton compiles (disk-cache loads included) by phase and kernel from now on:
    "ahead" (the compile-ahead pool's threads), "capture" (inside any graph capture, decode or
    prefill), "other" (elsewhere, e.g. the compile-ahead's calling thread or a first generate)."""
    import collections
    import threading

    from triton import knobs

    from rollout import cuda_graph_runner, graph_capture, prefill_graphs

    counts: dict = collections.defaultdict(collections.Counter)
    capturing = [False]

    def post_compile(*, fn, **_):
        worker = threading.current_thread().name.startswith("triton-compile")
        phase = "ahead" if worker else "capture" if capturing[0] else "other"
        counts[phase][fn.name] += 1

    def watched(forward, pool):
        capturing[0] = True
        try:
            return graph_capture.capture_graph(forward, pool)
        finally:
            capturing[0] = False

    knobs.runtime.jit_post_compile_hook = post_compile
    cuda_graph_runner.capture_graph = prefill_graphs.capture_graph = watched
    return counts


def compile_total(counts: dict) -> int:
    """Compiles counted by `watch_compiles` so far, every phase."""
    return sum(sum(c.values()) for c in counts.values())


def child(workers: int) -> dict:
    import torch

    from benchmarks.decode_throughput import gpu_engine_config, model_dir_for
    from rollout import Engine, SamplingParams

    compiles = watch_compiles()
    model_dir = model_dir_for("qwen2-1.5b")
    t0 = time.perf_counter()
    engine = Engine(gpu_engine_config(model_dir, 128, compile_workers=workers))
    torch.cuda.synchronize()
    startup = time.perf_counter() - t0
    before = compile_total(compiles)
    t0 = time.perf_counter()
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    first = {"first_generate_s": round(time.perf_counter() - t0, 2),
             "first_generate_compiles": compile_total(compiles) - before}
    ahead = engine.runner.graph_runner.ahead
    return {"workers": workers, "startup_s": round(startup, 2), **first,
            "first_batches": [_first_batch(engine, name, prompts, compiles)
                              for name, prompts in _first_batches()],
            "capture_s": round(engine.runner.graph_runner.capture_s, 2), "ahead": vars(ahead),
            "compiles": {phase: dict(c) for phase, c in compiles.items()}}


def _first_batch(engine, name: str, prompts: list[list[int]], compiles: dict) -> dict:
    """One first `generate` of several requests: its seconds and the variants it compiled."""
    import torch

    from rollout import SamplingParams

    counted = {phase: dict(c) for phase, c in compiles.items()}
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True, seed=1))
    torch.cuda.synchronize()
    new = {f"{phase}:{k}": n - counted.get(phase, {}).get(k, 0)
           for phase, c in compiles.items() for k, n in c.items()}
    return {"batch": name, "s": round(time.perf_counter() - t0, 2),
            "compiled": {k: n for k, n in new.items() if n}}


def _first_batches() -> list[tuple[str, list[list[int]]]]:
    """Multi-request batches of the kinds a rollout starts with: ragged short prompts (one
    eager prefill of 3 requests, 39 tokens: the skinny GEMMs' rows, odd counts; of 8, 264
    tokens: cuBLAS), then the decode benchmark's 128 x 128 (two prefill chunks of 8,192)."""
    ragged = [[(7 * i + j) % 1000 + 1 for j in range(5 + 8 * i)] for i in range(8)]
    full = [[(i + j) % 1000 + 1 for j in range(128)] for i in range(128)]
    return [("3 ragged", ragged[:3]), ("8 ragged", ragged), ("128 x 128", full)]


def run_child(workers: int, cache: Path, timeout: float) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, __file__, "--child", str(workers)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"workers": workers, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=180)
    p.add_argument("--out", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)), flush=True)
        return
    runs = []
    root = Path(tempfile.mkdtemp(prefix="startup-"))
    for r in range(args.rounds):
        for w in args.workers:
            runs.append({"round": r, "cache": "cold", **run_child(w, root / f"{w}_{r}", args.timeout_s)})
            print(json.dumps(runs[-1]), flush=True)
    for w in args.workers:  # the last round's cache, now warm
        runs.append({"round": args.rounds - 1, "cache": "warm",
                     **run_child(w, root / f"{w}_{args.rounds - 1}", args.timeout_s)})
        print(json.dumps(runs[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"cpus": os.cpu_count(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
