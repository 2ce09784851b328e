"""Engine A/B on one GPU: the decode benchmark (engine alone) once per variant and round, one
process each, variants alternated, so every variant sees the same machine drift. A variant is
environment variables and/or skinny-GEMM launch-config entries (written to a file for
ROLLOUT_SKINNY_CONFIGS, as `gemv_launch.load_tuned` reads it; "configs_file" instead names such a
file, e.g. one a sweep wrote earlier in the same device call: $OUT is expanded; "configs_files"
several, those missing skipped (a sweep with no winner writes none); "script" runs
another script that takes decode_throughput.py's arguments, e.g. decode_ablated.py; "tree" runs
the variant from another source tree, e.g. an earlier commit unpacked from `git archive`, to
compare code that has no switch: $OUT and ~ are expanded, and the tree goes first on PYTHONPATH). Keys starting
with "_" are comments. A variants file records an experiment as it ran at its commit: an A/B
toggle it sets may since have been removed, its winner kept as the only code path.

  python benchmarks/engine_ab.py --variants benchmarks/ab_eighth_session.json --rounds 2 \
      --batch-sizes 1 128 --out $OUT/ab.json

Prints, per variant and batch, tok/s and the decode graph's replay ms of every round and their
medians; writes all of it as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def variant_env(name: str, spec: dict, tmp: Path) -> dict:
    env = dict(os.environ)
    env.pop("ROLLOUT_SKINNY_CONFIGS", None)
    env.update({k: str(v) for k, v in spec.get("env", {}).items()})
    entries = list(spec.get("configs", []))
    keep = spec.get("configs_file_keys")  # [[M, N, K, gated], ...]: only these entries
    files = spec.get("configs_files", []) + ([spec["configs_file"]]
                                            if spec.get("configs_file") else [])
    for file_name in files:
        path = Path(os.path.expandvars(file_name))
        if not path.exists() and spec.get("configs_files"):
            continue  # a sweep that found no winner, or did not finish, wrote none
        for e in json.loads(path.read_text()):
            if keep is None or [e["M"], e["N"], e["K"], e["gated"]] in keep:
                entries.append(e)
    if entries:
        cfg = tmp / f"configs_{name}.json"
        cfg.write_text(json.dumps(entries))
        env["ROLLOUT_SKINNY_CONFIGS"] = str(cfg)
    return env


def run_once(name: str, env: dict, args, out: Path, extra: list[str] = (),
             script: str = "benchmarks/decode_throughput.py", tree: str | None = None) -> dict:
    cmd = [sys.executable, script, "--shape", args.shape,
           "--device", "cuda", "--dtype", "bfloat16", "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--skip-hf",
           "--batch-sizes", *map(str, args.batch_sizes), "--out", str(out), *extra]
    if tree:
        tree = os.path.expanduser(os.path.expandvars(tree))
        env = env | {"PYTHONPATH": os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s,
                          cwd=tree)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    result = json.loads(out.read_text())
    return {str(r["batch"]): {"tok_per_s": r["engine"]["tok_per_s"],
                              "graph_replay_ms": r.get("graph_replay_ms"),
                              "step_graph_replay_ms": r.get("step_graph_replay_ms")}
            for r in result["rows"]} | {"startup_s": result["startup_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", required=True, help="JSON {name: {env, configs, configs_file, args, script}}")
    p.add_argument("--only", nargs="*", default=None, help="run these variants of the file")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=150)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    variants = json.loads(Path(args.variants).read_text())
    names = args.only or [n for n in variants if not n.startswith("_")]  # "_note": a comment
    tmp = Path(tempfile.mkdtemp())
    runs: dict = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names:
            res = run_once(n, variant_env(n, variants[n], tmp), args, tmp / f"{n}_{r}.json",
                           [str(a) for a in variants[n].get("args", [])],
                           variants[n].get("script", "benchmarks/decode_throughput.py"),
                           variants[n].get("tree"))
            runs[n].append(res)
            print(f"round {r} {n}: {json.dumps(res)[:400]}", flush=True)
            Path(args.out).write_text(json.dumps({"variants": variants, "runs": runs}, indent=1))
    summary = {}
    print(f"\n{'variant':24} {'batch':>5} {'tok/s (median)':>15} {'graph ms (median)':>18}  rounds")
    for n in names:
        for bs in map(str, args.batch_sizes):
            ok = [x[bs] for x in runs[n] if bs in x]
            if not ok:
                continue
            tok = statistics.median(x["tok_per_s"] for x in ok)
            ms = statistics.median(x["graph_replay_ms"] for x in ok)
            summary.setdefault(n, {})[bs] = {"tok_per_s": tok, "graph_replay_ms": ms}
            per = ", ".join(f"{x['tok_per_s']:.0f}/{x['graph_replay_ms']:.4f}" for x in ok)
            steps = [x["step_graph_replay_ms"] for x in ok if x.get("step_graph_replay_ms")]
            if steps:  # the whole step as one graph (step_graphs)
                summary[n][bs]["step_graph_replay_ms"] = statistics.median(steps)
                per += f"; step graph {statistics.median(steps):.4f}"
            print(f"{n:24} {bs:>5} {tok:15.1f} {ms:18.4f}  {per}")
    Path(args.out).write_text(json.dumps({"variants": variants, "runs": runs,
                                          "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
