"""Sampled tokens and logprobs of one fixed generate call, as JSON: run it from two source trees
(engine_ab's "tree") and compare the files to check that a change keeps what the engine samples.

  python benchmarks/sample_dump.py --out $OUT/samples_now.json
  python benchmarks/sample_dump.py --compare a.json b.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.decode_throughput import gpu_engine, prompts_for
from rollout import SamplingParams


def dump(out: str, batch: int, new_tokens: int) -> None:
    engine = gpu_engine("qwen2-1.5b", batch)
    prompts = [p[: 20 + 7 * i] for i, p in enumerate(prompts_for(batch, 128, 151936))]  # ragged
    rows = []
    for sp in (SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=3),
               SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)):
        for o in engine.generate(prompts, sp):
            rows.append({"tokens": list(o.token_ids), "logprobs": list(o.logprobs)})
    Path(out).write_text(json.dumps(rows))


def compare(a: str, b: str) -> None:
    ra, rb = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    same_tokens = sum(x["tokens"] == y["tokens"] for x, y in zip(ra, rb))
    same_logprobs = sum(x["logprobs"] == y["logprobs"] for x, y in zip(ra, rb))
    diffs = [abs(p - q) for x, y in zip(ra, rb) if x["tokens"] == y["tokens"]
             for p, q in zip(x["logprobs"], y["logprobs"])]
    print(json.dumps({"rows": len(ra), "same_tokens": same_tokens, "same_logprobs": same_logprobs,
                      "max_logprob_diff_where_tokens_equal": max(diffs, default=None)}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--compare", nargs=2)
    args = p.parse_args()
    compare(*args.compare) if args.compare else dump(args.out, args.batch, args.new_tokens)
