"""Where a generate call's wall time goes, unprofiled: the decode benchmark's call (prompt 128,
sampling at T=1) timed at several numbers of new tokens, engine alone, JSON out.

A call of n new tokens is one prefill (with the first token) and n - 1 decode steps, so
  fixed = t(1)                    the host's lead, the prefill, the first token, the tail
  step  = (t(N) - t(2)) / (N - 2) what one decode step costs the call (a slope: no fixed costs)
and next to `step`, the decode graph's replay time alone (back-to-back replays): their
difference is what each step spends outside the graph (sampler, copies, the req_to_token
write, the graph's launch, a host that falls behind). The profiler (step_timeline.py) slows
the host, which is what this leaves out.

  python benchmarks/call_breakdown.py --batch-sizes 1 128 --out $OUT/breakdown.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.cuda_timing import full_batch_graph, generate_seconds, replay_seconds
from benchmarks.decode_throughput import gpu_engine_config, model_dir_for, prompts_for
from rollout import Engine, SamplingParams


def call_seconds(engine, prompts, new_tokens: int, repeats: int, n: int = 1) -> list[float]:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=1, n=n)
    engine.generate(prompts, sp)  # warm-up at this length
    return [generate_seconds(engine, prompts, sp) for _ in range(repeats)]


def breakdown(engine, batch: int, prompt_len: int, lengths: list[int], repeats: int,
              samples: int = 1) -> dict:
    """`samples`: the batch is batch / samples prompts sampled that many times each."""
    prompts = prompts_for(batch // samples, prompt_len, engine.model_config.vocab_size)
    ms = {n: [t * 1e3 for t in call_seconds(engine, prompts, n, repeats, samples)]
          for n in lengths}
    med = {n: statistics.median(v) for n, v in ms.items()}
    longest = max(lengths)
    step = (med[longest] - med[2]) / (longest - 2)
    graph = full_batch_graph(engine, batch, prompt_len + longest, required=True)
    replay = replay_seconds(graph, 100) * 1e3
    return {"calls_ms": {str(n): [round(v, 3) for v in ms[n]] for n in lengths},
            "median_ms": {str(n): round(v, 3) for n, v in med.items()},
            "fixed_ms": round(med[1], 3), "step_ms": round(step, 4),
            "graph_replay_ms": round(replay, 4), "outside_graph_us_per_step": round((step - replay) * 1e3, 2),
            f"tok_per_s_{longest}": round(batch * longest / med[longest] * 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 128])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="a batch is batch / N prompts sampled N times each (GRPO groups)")
    p.add_argument("--no-share-prompt-kv", action="store_true",
                   help="each sample prefills its prompt alone (EngineConfig.share_prompt_kv)")
    p.add_argument("--prefill-graph-requests", type=int, nargs="+", default=None,
                   help="EngineConfig.cuda_graph_prefill_requests (default: the engine's; 1: "
                        "one-request prefill graphs only)")
    p.add_argument("--out", default="breakdown.json")
    args = p.parse_args()
    if 1 not in args.lengths or 2 not in args.lengths or max(args.lengths) < 3:
        p.error("--lengths must hold 1, 2 and a length above 2")
    graph_requests = args.prefill_graph_requests and tuple(args.prefill_graph_requests)
    engine = Engine(gpu_engine_config(model_dir_for(args.shape), max(args.batch_sizes),
                                      share_prompt_kv=not args.no_share_prompt_kv,
                                      cuda_graph_prefill_requests=graph_requests))
    result = {}
    for bs in args.batch_sizes:
        result[str(bs)] = breakdown(engine, bs, args.prompt_len, sorted(args.lengths), args.repeats,
                                    args.samples_per_prompt)
        print(f"bs={bs}: {json.dumps(result[str(bs)])}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
