"""An agent loop's rollout: each conversation its own asyncio task calling `agenerate` a turn at
a time, next to the same conversations driven in lockstep (one generate call per turn for all)
and one call after another (what an engine serving calls one at a time gives), in one run.

Every conversation starts from its own prompt (`--prompt-len` tokens), samples `--new-tokens`
tokens a turn, then appends a `--reply-len`-token "tool reply"; the prefix cache is on (each
turn finds the last one cached) and dropped between the modes. The serial mode runs only the
first `--serial-conversations` conversations (it is slow by design); its tok/s is of those.

  python benchmarks/agent_loop.py --shape cpu-small --device cpu --conversations 16 --turns 3
  python benchmarks/agent_loop.py --shape qwen2-1.5b --device cuda --conversations 64 --turns 4 \\
      --out $OUT/agent_loop.json
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import torch

from benchmarks.decode_throughput import SHAPES, model_dir_for
from benchmarks.multi_turn_rollout import conversation_options
from rollout import Engine, EngineConfig, SamplingParams


def first_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, min(vocab, 30000)) for _ in range(length)] for _ in range(n)]


def reply(conversation: int, turn: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(conversation * 1000 + turn)
    return [rng.randrange(1, min(vocab, 30000)) for _ in range(length)]


def params(conversation: int, turn: int, args) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True,
                          seed=conversation * 1000 + turn)


async def concurrent(engine: Engine, prompts, args, vocab) -> list[list[int]]:
    async def agent(c: int, conv: list[int]) -> list[int]:
        for turn in range(args.turns):
            (out,) = await engine.agenerate([conv], params(c, turn, args))
            conv = conv + out.token_ids + reply(c, turn, args.reply_len, vocab)
        return conv
    return list(await asyncio.gather(*[agent(c, p) for c, p in enumerate(prompts)]))


def lockstep(engine: Engine, prompts, args, vocab) -> list[list[int]]:
    convs = list(prompts)
    for turn in range(args.turns):
        outs = engine.generate(convs, [params(c, turn, args) for c in range(len(convs))])
        convs = [conv + o.token_ids + reply(c, turn, args.reply_len, vocab)
                 for c, (conv, o) in enumerate(zip(convs, outs))]
    return convs


def serial(engine: Engine, prompts, args, vocab) -> list[list[int]]:
    convs = []
    for c, conv in enumerate(prompts):
        for turn in range(args.turns):
            (out,) = engine.generate([conv], params(c, turn, args))
            conv = conv + out.token_ids + reply(c, turn, args.reply_len, vocab)
        convs.append(conv)
    return convs


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def main() -> None:
    ap = conversation_options(__doc__, turns=3, new_tokens=64, reply_len=32)
    ap.add_argument("--prompt-len", type=int, default=256, help="tokens of each task's first prompt")
    ap.add_argument("--serial-conversations", type=int, default=4,
                    help="conversations the one-call-at-a-time mode runs")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    vocab = SHAPES[args.shape].vocab_size
    engine = Engine(EngineConfig(model_path=str(model_dir_for(args.shape)), device=args.device,
                                 dtype=args.dtype or ("bfloat16" if cuda else "float32"),
                                 max_running_requests=max(args.conversations, 1),
                                 kv_cache_tokens=None if cuda else 1 << 17))
    prompts = first_prompts(args.conversations, args.prompt_len, vocab)
    lockstep(engine, prompts, args, vocab)  # warm-up: compiles, allocator
    result = {"args": vars(args), "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    modes = {"concurrent": lambda: asyncio.run(concurrent(engine, prompts, args, vocab)),
             "lockstep": lambda: lockstep(engine, prompts, args, vocab),
             "serial": lambda: serial(engine, prompts[:args.serial_conversations], args, vocab)}
    convs = {}
    for name, fn in modes.items():
        engine.scheduler.drop_prefix_cache()
        steps = engine.stats.steps
        convs[name], seconds = timed(fn, args.device)
        n = args.conversations if name != "serial" else args.serial_conversations
        result[name] = {"seconds": seconds, "tok_per_s": n * args.turns * args.new_tokens / seconds,
                        "steps": engine.stats.steps - steps}
        print(f"{name:10s} {result[name]['tok_per_s']:10.1f} tok/s  {seconds:.3f} s  "
              f"{result[name]['steps']} steps", flush=True)
    k = args.serial_conversations
    result["concurrent_equals_lockstep"] = sum(a == b for a, b in zip(convs["concurrent"], convs["lockstep"]))
    result["serial_equals_lockstep"] = sum(a == b for a, b in zip(convs["serial"], convs["lockstep"][:k]))
    result["speedup_vs_serial"] = result["concurrent"]["tok_per_s"] / result["serial"]["tok_per_s"]
    print(f"concurrent / serial {result['speedup_vs_serial']:.1f}x; conversations equal to "
          f"lockstep's: concurrent {result['concurrent_equals_lockstep']}/{args.conversations}, "
          f"serial {result['serial_equals_lockstep']}/{k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
