"""A rollout in continuous batching: more requests than the engine runs at once, prompts and
response lengths ragged, so requests finish at different steps and the waiting ones are
admitted a few at a time while the others decode (the shape of an RL rollout whose responses
end at their own EOS). Every admission is a prefill step that the running decodes wait for:
this measures what those steps cost the whole call. Engine alone, one engine configuration per
process (the suite alternates processes), JSON out.

  python benchmarks/staggered_rollout.py --requests 512 --max-running 128 \
      --prefill-graph-requests 1 --out $OUT/staggered_one.json

Lengths are drawn once from a seeded generator (the same workload for every variant): prompts
uniform in [--prompt-min, --prompt-max] tokens, responses in [--new-min, --new-max] (ignore_eos,
max_new_tokens per request); with --samples-per-prompt N, groups of N requests of one prompt. Reports per call: wall seconds, generated tokens/s, prefill steps
and how many of them replayed a prefill graph, decode steps."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.cuda_timing import generate_seconds
from benchmarks.decode_throughput import gpu_engine_config, model_dir_for
from rollout import Engine, SamplingParams


def workload(args, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Per request a prompt and its own response length; with --samples-per-prompt N, each
    prompt is repeated N times in a row (a GRPO group: its samples share the prompt's KV)."""
    g = torch.Generator().manual_seed(args.seed)
    if args.requests % args.samples_per_prompt:
        raise SystemExit("--requests must be a multiple of --samples-per-prompt")
    distinct = args.requests // args.samples_per_prompt
    lens = torch.randint(args.prompt_min, args.prompt_max + 1, (distinct,), generator=g)
    news = torch.randint(args.new_min, args.new_max + 1, (args.requests,), generator=g)
    prompts = [torch.randint(0, min(vocab, 256), (int(n),), generator=g).tolist() for n in lens]
    prompts = [p for p in prompts for _ in range(args.samples_per_prompt)]
    params = [SamplingParams(max_new_tokens=int(n), temperature=1.0, ignore_eos=True, seed=i)
              for i, n in enumerate(news)]
    return prompts, params


def counters(engine) -> dict:
    s, gr = engine.stats, engine.runner.graph_runner
    prefill = gr.prefill if gr is not None else None
    return {"steps": s.steps, "prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens,
            "mixed_decode_tokens": s.mixed_decode_tokens,
            "prefill_replays": prefill.num_replays if prefill is not None else 0,
            "decode_replays": gr.num_replays if gr is not None else 0}


def workload_options(p: argparse.ArgumentParser) -> None:
    """The model shape, the engine's running requests and the workload `workload` draws."""
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--new-min", type=int, default=16)
    p.add_argument("--new-max", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="each prompt N times in a row, as a GRPO group (prompt KV shared)")
    p.add_argument("--no-mixed-steps", action="store_true",
                   help="the running requests wait for each admission's step (EngineConfig.mixed_steps)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_options(p)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefill-graph-requests", type=int, nargs="+", default=None,
                   help="EngineConfig.cuda_graph_prefill_requests (default: the engine's; 1: "
                        "one-request prefill graphs only)")
    p.add_argument("--no-prefill-graphs", action="store_true", help="every prefill eager")
    p.add_argument("--out", default="staggered.json")
    args = p.parse_args()
    overrides = {}
    if args.prefill_graph_requests:
        overrides["cuda_graph_prefill_requests"] = tuple(args.prefill_graph_requests)
    if args.no_prefill_graphs:
        overrides["cuda_graph_prefill_tokens"] = ()
    if args.no_mixed_steps:
        overrides["mixed_steps"] = False
    engine = Engine(gpu_engine_config(model_dir_for(args.shape), args.max_running, **overrides))
    prompts, params = workload(args, engine.model_config.vocab_size)
    generated = sum(sp.max_new_tokens for sp in params)
    generate_seconds(engine, prompts[:args.max_running], params[:args.max_running])  # warm-up
    calls = []
    for _ in range(args.repeats):
        before = counters(engine)
        seconds = generate_seconds(engine, prompts, params)
        after = counters(engine)
        calls.append({"seconds": round(seconds, 4), "tok_per_s": round(generated / seconds, 1),
                      **{k: after[k] - before[k] for k in after}})
        print(json.dumps(calls[-1]), flush=True)
    result = {"args": vars(args), "generated_tokens": generated,
              "prompt_tokens": sum(map(len, prompts)),
              "median_tok_per_s": statistics.median(c["tok_per_s"] for c in calls), "calls": calls}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
