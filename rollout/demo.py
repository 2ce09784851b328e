"""The README's main job: GRPO-style sampling on the embedded tiny model, shown as a table."""
from __future__ import annotations

import time
from typing import Optional

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.sampling_params import SamplingParams

DEMO_PROMPTS = ["The quick brown fox", "def add(a, b):", "2 + 2 =", "Once upon a time"]


def run_demo(model_path: Optional[str] = None, num_samples: int = 4, max_new_tokens: int = 24,
             seed: int = 0, device: str = "cpu") -> dict:
    """Generate `num_samples` samples per prompt; print a table and the throughput."""
    from rich.console import Console
    from rich.table import Table

    engine = Engine(EngineConfig(model_path=model_path, device=device, seed=seed))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_p=0.95,
                            n=num_samples, seed=seed)
    start = time.perf_counter()
    outs = engine.generate(DEMO_PROMPTS, params)
    elapsed = time.perf_counter() - start
    table = Table(title=f"{len(DEMO_PROMPTS)} prompts x {num_samples} samples "
                        f"(weight version {engine.weight_version})")
    for col in ("prompt", "#", "sample", "logprob sum", "finish"):
        table.add_column(col)
    for o in outs:
        prompt = DEMO_PROMPTS[o.prompt_index]
        table.add_row(prompt, str(o.sample_index), repr(o.text)[:40], f"{o.cumulative_logprob:.2f}",
                      o.finish_reason)
    tokens = sum(len(o.token_ids) for o in outs)
    console = Console()
    console.print(table)
    console.print(f"{tokens} tokens in {elapsed:.3f} s: {tokens / elapsed:,.0f} tok/s "
                  f"(model {engine.config.model_path})")
    return {"tokens": tokens, "seconds": elapsed, "outputs": outs}
