"""An agentic rollout: every trajectory its own asyncio task, a turn at a time, with a tool.

    python examples/agent_rollout.py                     # CPU, the embedded tiny model, seconds
    python examples/agent_rollout.py --device cuda --dtype bfloat16 --model-path /path/to/hf_dir

Each trajectory asks the engine for a turn (`await engine.agenerate([conversation], ...)`),
hands the sample to a tool, appends the tool's reply and asks again, up to `--turns` turns or
until the sample ends on its stop token. The conversation is kept as token ids — the sampled ids
as they are, only the tool's text encoded — so no turn re-tokenizes what the model wrote (its
text decoded and encoded again need not give the same ids, and the trainer must see those). The trajectories run at once, and the engine batches
their calls together (calls in flight share its batch); each turn finds the conversation so far
in the prefix cache and computes only the new tokens (`cached_tokens`). At the end the rollout's
samples are scored by the same engine (`engine.score`), as a trainer's reference policy would
score them, and the scores equal the logprobs the samples came with.

Simplifications: the tiny random model's text is noise, so the tool is a stand-in (it replies
with the byte count of the sample); no reward, no training step (examples/grpo.py has those)."""
from __future__ import annotations

import argparse
import asyncio
import time

from rollout import Engine, EngineConfig, SamplingParams


def encode(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False).ids


def tool(sample: str) -> str:
    return f"\n[tool] {len(sample.encode())} bytes\n"


async def trajectory(engine: Engine, task: str, index: int, args) -> dict:
    conversation, turns = encode(engine, task), []
    for turn in range(args.turns):
        sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=index * 100 + turn)
        (out,) = await engine.agenerate([conversation], sp)
        turns.append({"prompt_tokens": len(out.prompt_token_ids), "cached": out.cached_tokens,
                      "ids": out.prompt_token_ids + out.token_ids, "start": len(out.prompt_token_ids),
                      "logprobs": out.logprobs})
        if out.finish_reason == "stop":
            break
        conversation = conversation + out.token_ids + encode(engine, tool(out.text))
    return {"task": index, "turns": turns}


async def rollout(engine: Engine, args) -> list[dict]:
    tasks = [f"Task {i}: count the bytes of what you write.\n" for i in range(args.trajectories)]
    return await asyncio.gather(*[trajectory(engine, t, i, args) for i, t in enumerate(tasks)])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="HF model directory (default: tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype))
    start = time.perf_counter()
    results = asyncio.run(rollout(engine, args))
    seconds = time.perf_counter() - start
    turns = [t for r in results for t in r["turns"]]
    print(f"{len(results)} trajectories, {len(turns)} turns in {seconds:.2f} s, "
          f"{engine.stats.steps} engine steps (one call after another would take "
          f"~{len(turns) * args.new_tokens})")
    print(f"prompt tokens {sum(t['prompt_tokens'] for t in turns)}, of them found in the prefix "
          f"cache {sum(t['cached'] for t in turns)}")
    scores = engine.score([t["ids"] for t in turns], start=[t["start"] for t in turns])
    gap = max((abs(a - b) for t, s in zip(turns, scores) for a, b in zip(t["logprobs"], s)), default=0.0)
    print(f"re-scored every sample: max |score - sampled logprob| = {gap:.2e}")
    steps = engine.stats.steps
    engine.shutdown()
    return {"trajectories": results, "steps": steps, "score_gap": gap}


if __name__ == "__main__":
    main()
