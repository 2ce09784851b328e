"""Which Triton kernel variants the batch-1 decode graph runs, by the engine's sizing.

The twenty-sixth session's `shape26` A/B found the batch-1 decode graph slower in an engine
sized for 128 requests with its 17 graph sizes (split attention 1.0081 ms, per-head 1.0201)
than in one sized for 128 with the batch-1 graph alone (1.0049, 1.0046) or for one request
(1.0045, 1.0046). This lists, per sizing (each its own process), every Triton launch of that
graph's forward with its specialization key (argument dtypes, integer and pointer-alignment
specializations, constexprs): with the in-memory caches emptied, each launch is a miss that the
recording `jit_cache_hook` sees and skips. A difference between two sizings names the kernel
and argument that compile differently; none points at the memory layout instead.

  python benchmarks/graph_variants.py --shapes 128: 128:1 1: --out $OUT/graph_variants.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def child(max_running: int, graph_sizes: tuple[int, ...] | None) -> dict:
    import gc

    from triton import knobs
    from triton.runtime.jit import JITFunction

    from benchmarks.decode_throughput import gpu_engine_config, model_dir_for
    from rollout import Engine

    overrides = {"cuda_graph_batch_sizes": graph_sizes} if graph_sizes else {}
    engine = Engine(gpu_engine_config(model_dir_for("qwen2-1.5b"), max_running, **overrides))
    gr = engine.runner.graph_runner
    launches: list[list[str]] = []

    def record(*, key, fn, **_):
        launches.append([fn.name, str(key)])
        return True  # skip the launch

    for f in [o for o in gc.get_objects() if isinstance(o, JITFunction)]:
        f.device_caches.clear()  # every launch below misses and reaches the hook
    (key, max_seq_len), = [(k, n) for k, n in gr.graph_keys() if k == (1, 0)]
    knobs.runtime.jit_cache_hook = record
    try:
        gr._compile_forward(1, max_seq_len)
    finally:
        knobs.runtime.jit_cache_hook = None
    inputs = gr.inputs
    return {"max_running": max_running, "graph_sizes": graph_sizes, "max_bs": gr.max_bs,
            "table_row_bytes": inputs.table.stride(0) * inputs.table.element_size(),
            "launches": launches}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["128:", "128:1", "1:"],
                   help="MAX_RUNNING:GRAPH_SIZES (comma-separated; empty: the engine's)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        running, sizes = args.child.split(":")
        graph_sizes = tuple(int(s) for s in sizes.split(",")) if sizes else None
        print(json.dumps(child(int(running), graph_sizes)), flush=True)
        return
    runs = {}
    for shape in args.shapes:
        proc = subprocess.run([sys.executable, __file__, "--child", shape], capture_output=True,
                              text=True, timeout=300)
        runs[shape] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                       else {"error": proc.stderr[-2000:]})
    base_name, base = args.shapes[0], runs[args.shapes[0]]
    for name, run in runs.items():
        if "error" in run or "error" in base:
            print(name, run.get("error", "")[-500:])
            continue
        diff = [(i, a, b) for i, (a, b) in enumerate(zip(base["launches"], run["launches"])) if a != b]
        print(f"{name}: {len(run['launches'])} launches, max_bs {run['max_bs']}, "
              f"{len(diff)} differ from {base_name}")
        for i, a, b in diff[:12]:
            print(f"  #{i} {a[0]}\n    {base_name}: {a[1]}\n    {name}: {b[1]}")
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
