"""Where a `generate` call makes the host wait for the GPU: torch's sync debug mode over whole
calls (prefill and decode steps), each synchronizing op counted once per call site, with the
stack that reached it.

The engine's contract is one host wait a decode step, for the sampled tokens (the pinned copy's
event), which torch does not report (an event wait is no torch op); anything this script lists
is a torch op that synchronizes — e.g. `.tolist()` / `.item()` of a device tensor, a boolean-mask
index or `nonzero` — and so a stall of the host's lead (at batch 128 the prefill of 16,384 tokens
spends ≈5 ms with the GPU idle between kernels, `prefill_kernel_profile.py`).

  python benchmarks/sync_audit.py --batch-sizes 1 128 --out $OUT/sync_audit.json
"""
from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings
from pathlib import Path

import torch

from benchmarks.decode_throughput import gpu_engine, prompts_for
from rollout import SamplingParams


# printed once per process when the mode is first set: a notice, not a sync
_NOTICE = "Synchronization debug mode is a prototype feature"


def synchronizing_ops(run) -> tuple[collections.Counter, dict[str, str]]:
    """The synchronizing torch ops `run()` makes: counts by call site (the innermost frame in
    rollout/, or the caller's), and each site's stack."""
    sites: collections.Counter = collections.Counter()
    stacks: dict[str, str] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if _NOTICE in str(message):
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if "/rollout/" in f.filename] or frames[-1:]
        where = f"{ours[-1].filename.rsplit('/', 2)[-1]}:{ours[-1].lineno}"
        key = f"{where}: {str(message)[:80]}"
        sites[key] += 1
        stacks.setdefault(key, "".join(traceback.format_list(ours[-6:])))

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record  # restored by catch_warnings
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sites, stacks


def audit(engine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    prompts = prompts_for(batch, prompt_len, engine.model_config.vocab_size)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=1)
    engine.generate(prompts, sp)  # warm-up: compiles and allocations out of the way
    sites, stacks = synchronizing_ops(lambda: engine.generate(prompts, sp))
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "syncs": dict(sites), "stacks": stacks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2-1.5b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # the control: an .item() of a device tensor must be seen, or an empty audit means nothing
    control, _ = synchronizing_ops(lambda: torch.ones(1, device="cuda").item())
    if not control:
        raise SystemExit("torch's sync debug mode reported no sync for .item(): cannot audit")
    print(f"control: {sum(control.values())} sync(s) seen for one .item()")
    engine = gpu_engine(args.shape, max(args.batch_sizes))
    results = [audit(engine, b, args.prompt_len, args.new_tokens) for b in args.batch_sizes]
    for r in results:
        print(f"batch {r['batch']}: {sum(r['syncs'].values())} synchronizing torch ops in a call "
              f"of {r['new_tokens']} new tokens")
        for site, n in sorted(r["syncs"].items(), key=lambda kv: -kv[1]):
            print(f"  {n:5d}x  {site}")
            print("        " + r["stacks"][site].replace("\n", "\n        ").rstrip())
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
