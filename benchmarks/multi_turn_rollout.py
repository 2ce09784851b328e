"""Multi-turn (agentic) rollouts with the prefix cache on and off, side by side in one run.

Each of `--conversations` conversations starts from its own prompt of `--system-len` tokens
shared by all (a system prompt) plus `--task-len` of its own; every turn samples
`--new-tokens` tokens, then appends `--reply-len` tokens of a "tool reply", and the next turn's
prompt is the whole conversation so far. One engine with the cache, one without, the same
prompts, seeds and replies; per turn: wall time, prefill tokens computed, tokens found cached.
With `--weight-update-every K`, every K turns a new weight version is committed (the same
values: what the engine does after any update's load), which empties the cache as every weight
update does: the next turn pays its whole prompt.

  python benchmarks/multi_turn_rollout.py --shape cpu-small --device cpu --conversations 16 \
      --turns 4 --system-len 64 --task-len 32 --new-tokens 32 --reply-len 16
  python benchmarks/multi_turn_rollout.py --shape qwen2-1.5b --device cuda --conversations 64 \
      --turns 6 --out $OUT/multi_turn.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from benchmarks.decode_throughput import SHAPES, model_dir_for
from rollout import Engine, EngineConfig, SamplingParams


def make_engine(model_dir, args, cache: bool) -> Engine:
    cuda = args.device == "cuda"
    return Engine(EngineConfig(model_path=str(model_dir), device=args.device,
                               dtype="bfloat16" if cuda else "float32",
                               max_running_requests=max(args.conversations, 1),
                               kv_cache_tokens=None if cuda else 1 << 17, prefix_cache=cache))


def first_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(1, min(vocab, 30000)) for _ in range(args.system_len)]
    return [system + [rng.randrange(1, min(vocab, 30000)) for _ in range(args.task_len)]
            for _ in range(args.conversations)]


def run_turns(engine: Engine, args, vocab: int) -> dict:
    prompts, rng, turns, outputs = first_prompts(args, vocab), random.Random(1), [], []
    every = args.weight_update_every
    for turn in range(args.turns):
        if every and turn and turn % every == 0:
            with engine.paused():
                engine.commit_weight_version(engine.weight_version + 1)
        sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=turn,
                            ignore_eos=True)
        before = (engine.stats.prefill_tokens, engine.stats.cached_prompt_tokens)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sp)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        turns.append({"turn": turn, "wall_s": wall,
                      "prompt_tokens": sum(map(len, prompts)),
                      "prefill_tokens": engine.stats.prefill_tokens - before[0],
                      "cached_tokens": engine.stats.cached_prompt_tokens - before[1],
                      "new_tokens": sum(len(o.token_ids) for o in outs),
                      "tok_per_s": sum(len(o.token_ids) for o in outs) / wall})
        outputs.append([o.token_ids for o in outs])
        prompts = [o.prompt_token_ids + o.token_ids
                   + [rng.randrange(1, min(vocab, 30000)) for _ in range(args.reply_len)]
                   for o in outs]
    total = sum(t["wall_s"] for t in turns)
    return {"turns": turns, "wall_s": total,
            "tok_per_s": sum(t["new_tokens"] for t in turns) / total, "outputs": outputs}


def conversation_options(doc: str, turns: int, new_tokens: int, reply_len: int) -> argparse.ArgumentParser:
    """The options of a rollout of conversations (this benchmark's and `agent_loop.py`'s)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="cpu-small", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--conversations", type=int, default=16, help="conversations run at once")
    ap.add_argument("--turns", type=int, default=turns, help="generate calls of each conversation")
    ap.add_argument("--new-tokens", type=int, default=new_tokens, help="tokens sampled a turn")
    ap.add_argument("--reply-len", type=int, default=reply_len, help="tokens of the tool reply a turn")
    ap.add_argument("--out", help="JSON file to write")
    return ap


def main() -> None:
    ap = conversation_options(__doc__, turns=4, new_tokens=128, reply_len=64)
    ap.add_argument("--system-len", type=int, default=512, help="tokens of the shared system prompt")
    ap.add_argument("--task-len", type=int, default=128, help="tokens of each conversation's own start")
    ap.add_argument("--weight-update-every", type=int, default=0,
                    help="commit a new weight version every K turns (0: never)")
    args = ap.parse_args()
    model_dir = model_dir_for(args.shape)
    vocab = SHAPES[args.shape].vocab_size
    result = {"args": vars(args), "device": torch.cuda.get_device_name() if args.device == "cuda"
              else "cpu", "date": time.strftime("%Y-%m-%d")}
    for cache in (True, False):
        engine = make_engine(model_dir, args, cache)
        run_turns(engine, args, vocab)  # warm-up: compiles, allocator; emptied below
        engine.scheduler.drop_prefix_cache()
        result["cache" if cache else "no_cache"] = run_turns(engine, args, vocab)
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    on, off = result["cache"], result["no_cache"]
    same = [a == b for ta, tb in zip(on.pop("outputs"), off.pop("outputs")) for a, b in zip(ta, tb)]
    result["samples_equal"] = f"{sum(same)}/{len(same)}"
    result["speedup"] = on["tok_per_s"] / off["tok_per_s"]
    for name in ("cache", "no_cache"):
        r = result[name]
        print(f"{name:9s} {r['tok_per_s']:10.1f} tok/s  {r['wall_s']:.3f} s  per turn (s): "
              + " ".join(f"{t['wall_s']:.3f}" for t in r["turns"])
              + "  prefill tokens: " + " ".join(str(t["prefill_tokens"]) for t in r["turns"]))
    print(f"speedup {result['speedup']:.2f}x, samples equal {result['samples_equal']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
