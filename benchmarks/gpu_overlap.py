"""Overlap scheduling, measured: the same engine with `overlap_schedule` off and on, in one run,
next to the decode CUDA graph's replay time alone (what the step would cost if the host's work
were fully hidden). Qwen2-1.5B shape, bf16, prompt 128, sampling, JSON to --out.

  python benchmarks/gpu_overlap.py --batch-sizes 1 32 128 --out $OUT/overlap.json
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from benchmarks.decode_throughput import SHAPES, engine_runner, model_dir_for, timed
from benchmarks.profile_decode import replay_ms
from benchmarks.gpu_parity import ragged_prompts
from rollout import Engine, EngineConfig, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--out", default="overlap.json")
    args = p.parse_args()
    args.device = "cuda"
    path = model_dir_for("qwen2-1.5b")
    rows = {bs: {"batch": bs} for bs in args.batch_sizes}
    prompts = ragged_prompts(SHAPES["qwen2-1.5b"].vocab_size) * 4  # 32 ragged prompts
    check = [SamplingParams(max_new_tokens=24 + 3 * (i % 5), temperature=0.0 if i % 2 else 1.0, seed=i,
                            top_p=0.9 if i % 3 == 0 else 1.0) for i in range(len(prompts))]
    outputs = {}
    for overlap in (False, True):
        engine = Engine(EngineConfig(model_path=str(path), device="cuda", dtype="bfloat16",
                                     attention_backend=args.attention_backend, overlap_schedule=overlap,
                                     max_running_requests=max(args.batch_sizes),
                                     prefix_cache=False))  # repeated prompts: time them uncached
        outputs[overlap] = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, check)]
        for bs in args.batch_sizes:
            r = timed(engine_runner(engine, bs, args), args.repeats)
            rows[bs]["overlap" if overlap else "sequential"] = r
            rows[bs]["ms_per_step_" + ("overlap" if overlap else "sequential")] = (
                r["seconds"] / args.new_tokens * 1e3)
            rows[bs]["graph_replay_ms"] = replay_ms(engine, bs)
            print(json.dumps(rows[bs]), flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    for row in rows.values():
        row["speedup"] = row["overlap"]["tok_per_s"] / row["sequential"]["tok_per_s"]
    same = [a[0] == b[0] for a, b in zip(outputs[False], outputs[True])]
    max_lp = max(abs(x - y) for a, b in zip(outputs[False], outputs[True]) for x, y in zip(a[1], b[1]))
    result = {"outputs_equal": all(same), "samples_equal": sum(same), "samples": len(same),
              "max_logprob_diff": max_lp, "shape": "qwen2-1.5b", "backend": args.attention_backend, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "rows": list(rows.values())}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"overlap vs sequential outputs: {sum(same)}/{len(same)} samples equal, max |Δlogprob| {max_lp:.2e}")
    for row in rows.values():
        print(f"bs={row['batch']:4d}  sequential {row['sequential']['tok_per_s']:9.0f} tok/s  "
              f"overlap {row['overlap']['tok_per_s']:9.0f} tok/s  ×{row['speedup']:.2f}  "
              f"(ms/step {row['ms_per_step_sequential']:.2f} → {row['ms_per_step_overlap']:.2f}; "
              f"graph replay {row['graph_replay_ms']:.2f})")


if __name__ == "__main__":
    main()
