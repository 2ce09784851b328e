"""The decode step's L2 weight prefetch (`rollout/l2_prefetch.py`) at several budgets, A/B in one
process: the same engine recaptures its CUDA graphs at each budget, rounds alternate the
budgets, and each budget is timed by its decode graph's replay alone and by whole `generate`
calls (prefill included, as decode_throughput.py counts). A prefetch must change no value: the
greedy tokens and log-probabilities of every budget are checked equal to budget 0's first.

  python benchmarks/gpu_l2_prefetch.py --budgets-mb 0 16 32 --out $OUT/l2_prefetch.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cuda_timing import replay_seconds
from benchmarks.decode_throughput import SHAPES, prompts_for
from rollout import Engine, EngineConfig, SamplingParams
from rollout.tiny_model import make_tiny_model


def greedy(engine: Engine, prompts) -> list[tuple[list[int], list[float]]]:
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, sp)]


def timed_generate(engine: Engine, prompts, new_tokens: int) -> float:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2-1.5b", choices=sorted(SHAPES))
    p.add_argument("--budgets-mb", type=float, nargs="+", default=[0, 16, 32])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / args.shape, SHAPES[args.shape],
                                with_tokenizer=False)
    engine = Engine(EngineConfig(model_path=str(model_dir), device="cuda", dtype="bfloat16",
                                 max_running_requests=max(args.batch_sizes),
                                 decode_l2_prefetch_mb=0))
    runner, vocab = engine.runner, engine.model_config.vocab_size
    props = torch.cuda.get_device_properties(runner.device)
    parity_prompts = [prompts_for(1, n, vocab, seed=n)[0] for n in (5, 17, 40, 77, 128, 129, 200, 9)]
    result = {"device": props.name, "l2_cache_bytes": props.L2_cache_size, "torch": torch.__version__,
              "budgets_mb": args.budgets_mb, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "runs": [], "parity": {}}
    reference = None
    for rnd in range(args.rounds):
        for mb in args.budgets_mb:
            runner.set_l2_prefetch(int(mb * 2**20))
            layer0 = runner.model.model.layers[0].self_attn.l2_prefetch
            out = greedy(engine, parity_prompts)
            if reference is None:
                reference = out
            same = out == reference
            result["parity"].setdefault(str(mb), []).append(same)
            for bs in args.batch_sizes:
                prompts = prompts_for(bs, args.prompt_len, vocab)
                engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
                gr = runner.graph_runner
                graph_bs = min(s for s in gr.batch_sizes if s >= bs)
                replay = replay_seconds(gr.graphs[graph_bs], 50) * 1e3
                tps = [timed_generate(engine, prompts, args.new_tokens) for _ in range(2)]
                row = {"round": rnd, "budget_mb": mb, "batch": bs, "replay_ms": replay,
                       "tok_per_s": tps, "prefetched_bytes": layer0.nbytes if layer0 else 0,
                       "greedy_equal_to_first_budget": same}
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for mb in args.budgets_mb:
        for bs in args.batch_sizes:
            rows = [r for r in result["runs"] if r["budget_mb"] == mb and r["batch"] == bs]
            summary[f"{mb:g}MB/b{bs}"] = {
                "replay_ms_median": statistics.median(r["replay_ms"] for r in rows),
                "tok_per_s_median": statistics.median(t for r in rows for t in r["tok_per_s"])}
    result["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
