"""Quickstart: one Engine, then tensor parallelism (TP) and data parallelism (DP) on one machine.

    python examples/quickstart.py                  # CPU: a tiny random model, local Ray
    python examples/quickstart.py --device cuda --model-path /path/to/hf_dir --tp 2 --dp 2

Simplifications: the default model is the embedded tiny random model (its text is noise; the
point is that all three layouts give the same tokens for the same seeds). On CPU, Ray is started
with as many logical CPUs as the shards need (one per shard), even if the machine has fewer.
With $RAY_ADDRESS set, the controller joins that cluster instead of starting one."""
from __future__ import annotations

import argparse
import logging
import time

from actors import RolloutController
from actors.cluster import connect
from rollout import Engine, EngineConfig, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="HF model directory (default: tiny model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of each replica")
    p.add_argument("--dp", type=int, default=2, help="number of data-parallel replicas")
    p.add_argument("--max-new-tokens", type=int, default=24)
    return p.parse_args()


def run(name: str, generate, sp: SamplingParams) -> list[list[int]]:
    start = time.perf_counter()
    outs = generate(PROMPTS, sp)
    print(f"{name:<14} {time.perf_counter() - start:6.2f}s  first sample: {outs[0].token_ids[:8]}")
    return [o.token_ids for o in outs]


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    base = dict(model_path=args.model_path, device=args.device, kv_cache_tokens=8192)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1234, n=2)

    engine = Engine(EngineConfig(**base))
    reference = run("Engine", engine.generate, sp)
    engine.shutdown()

    connect(min_cpus=args.tp * args.dp)  # one Ray session for all three layouts ($RAY_ADDRESS wins)
    layouts = [("TP", args.tp, 1), ("DP", 1, args.dp), ("TP x DP", args.tp, args.dp)]
    for name, tp, dp in layouts:
        with RolloutController(EngineConfig(tp_size=tp, **base), num_replicas=dp) as ctl:
            tokens = run(f"{name} {tp}x{dp}", ctl.generate, sp)
            print(f"{'':<14} same tokens as the single Engine: {tokens == reference}")
            print(f"{'':<14} replicas: {[(s['index'], s['node_id'][:8], s['alive']) for s in ctl.status()]}")


if __name__ == "__main__":
    main()
