"""The host cost of `generate` up to and between prefill forwards, measured on CPU.

On a GPU, `generate(128 prompts x 128 tokens)` spends host time from the call to the first
forward (requests, admission, the first prefill batch's metadata) and between the prefill
batches (the prefill budget, 8,192 tokens on a GPU, makes two of them). This script measures
that host work on CPU, where it is the same Python: the runner's `forward_eager` (the model,
its attention metadata and the LM head) is replaced by a stub that only asks the batch for
its logits rows (`ForwardBatch.logits_indices`, as the LM head does) and returns logits of
the right shape. What remains is the engine's own host work: building requests, admission,
batch and sampling metadata, the KV table write, the sampler (real, on tiny logits) and the
outputs. Each generate asks for one new token, so it is the prefill path alone.

Scheduling overlaps as on one GPU (`--no-overlap`: sequential, the CPU default). It prints
the median wall time of stubbed calls per batch size (A/B runs: alternate two checkouts,
several repeats, compare medians); for the largest batch the median time of each stage in a
call, the host time from the call to the first forward and between the first two forwards
(the prefill chunks); then a cProfile of the stubbed calls (own time per function).

  PYTHONPATH=. python benchmarks/prefill_host_cpu.py
  PYTHONPATH=. python benchmarks/prefill_host_cpu.py --batches 128 --calls 50 --top 30
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

from rollout import Engine, EngineConfig, SamplingParams, model_runner, scheduler
from rollout import engine as engine_module
from rollout.forward_batch import ForwardBatch
from rollout.request_builder import RequestBuilder
from rollout.sampling_info import SamplingBatchInfo
from rollout.tiny_model import TinyModelSpec, make_tiny_model

# sampling (temperature 1, seeded): the path `generate` takes in RL rollouts
PREFILL_ONLY = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True, seed=1)


def stub_forward(engine: Engine) -> None:
    """Replace the model's work with logits of the right shape (this engine only). The stub
    still asks the batch for the rows whose logits are needed, as `compute_logits` does."""
    vocab = engine.model_config.vocab_size
    logits_by_rows: dict[int, torch.Tensor] = {}

    def forward_eager(fb: ForwardBatch) -> torch.Tensor:
        rows = fb.logits_indices()
        n = fb.num_tokens if rows is None else rows.numel()
        if n not in logits_by_rows:  # made once per shape: the stub itself costs ~nothing
            logits_by_rows[n] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n))
        return logits_by_rows[n]

    engine.runner.forward_eager = forward_eager


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def timed_ms(engine: Engine, prompts: list[list[int]], calls: int) -> list[float]:
    walls = []
    for _ in range(calls):
        t0 = time.perf_counter()
        engine.generate(prompts, PREFILL_ONLY)
        walls.append((time.perf_counter() - t0) * 1e3)
    return walls


# The stages of the prefill path, timed by wrapping the functions (a timer costs ~1 µs a call,
# against the profiler's per-call overhead on every function below them).
PHASES: list[tuple[str, object, str]] = [
    ("requests: build + validate", RequestBuilder, "build"),
    ("admission (all, incl. below)", scheduler.Scheduler, "_admit"),
    ("  build_batch", scheduler, "build_batch"),
    ("  SamplingBatchInfo.build", SamplingBatchInfo, "build"),
    ("forward: runner (KV table write + stub)", model_runner.ModelRunner, "forward"),
    ("sample", model_runner.ModelRunner, "sample"),
    ("complete: apply tokens, free KV", scheduler.Scheduler, "_complete"),
    ("outputs", engine_module.Engine, "_output"),
]


@contextmanager
def phase_timers() -> Iterator[dict[str, list[tuple[float, float]]]]:
    """Wraps each PHASES function with a timer; yields name -> (start, end) of each call."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    saved = []
    for name, owner, attr in PHASES:
        raw = owner.__dict__[attr]
        fn = raw.__func__ if isinstance(raw, classmethod) else raw
        saved.append((owner, attr, raw))

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spans[_name].append((t0, time.perf_counter()))

        setattr(owner, attr, classmethod(timed) if isinstance(raw, classmethod) else timed)
    try:
        yield spans
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)


FORWARD = PHASES[4][0]


def phases_text(engine: Engine, prompts: list[list[int]], calls: int) -> str:
    """Per stage, the median over calls of its time in one call; and the host time from the
    call to the first forward and between the first two forwards (the prefill chunks)."""
    per_call: dict[str, list[float]] = defaultdict(list)
    walls = []
    for _ in range(calls):
        with phase_timers() as spans:
            t0 = time.perf_counter()
            engine.generate(prompts, PREFILL_ONLY)
            walls.append(time.perf_counter() - t0)
        for name, _, _ in PHASES:
            per_call[name].append(sum(end - start for start, end in spans[name]))
        forwards = spans[FORWARD]
        per_call["call -> 1st forward"].append(forwards[0][0] - t0)
        if len(forwards) > 1:
            per_call["1st forward -> 2nd forward"].append(forwards[1][0] - forwards[0][1])
    out = [f"stages of one call, {len(prompts)} prompts, median of {calls} (timers on: "
           f"call {statistics.median(walls) * 1e3:.3f} ms)"]
    for name, values in per_call.items():
        out.append(f"  {name:42s} {statistics.median(values) * 1e3:7.3f} ms")
    return "\n".join(out) + "\n"


def profile_text(engine: Engine, prompts: list[list[int]], calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        engine.generate(prompts, PREFILL_ONLY)
    prof.disable()
    out = io.StringIO()
    out.write(f"cProfile of {calls} stubbed calls, {len(prompts)} prompts (totals over all calls)\n")
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 128])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="tokens one prefill batch may compute (the GPU default: two batches at 128x128)")
    p.add_argument("--calls", type=int, default=30, help="timed calls per batch size")
    p.add_argument("--profile-calls", type=int, default=20)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-overlap", action="store_true",
                   help="sequential scheduling (the CPU default); default: overlap, as on one GPU")
    p.add_argument("--real-forward", action="store_true",
                   help="keep the model's forward (to see the host share of a real CPU call)")
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args()
    torch.set_num_threads(1)  # the host path is single-threaded Python; keep the numbers steady
    with tempfile.TemporaryDirectory() as d:
        make_tiny_model(d, TinyModelSpec(), with_tokenizer=False)
        biggest = max(args.batches)
        engine = Engine(EngineConfig(model_path=d, device="cpu", max_running_requests=biggest,
                                     max_prefill_tokens=args.max_prefill_tokens,
                                     overlap_schedule=not args.no_overlap,
                                     kv_cache_tokens=2 * biggest * (args.prompt_len + 1),
                                     prefix_cache=False))  # repeated prompts: time them uncached
        if not args.real_forward:
            stub_forward(engine)
        text = io.StringIO()
        for b in args.batches:
            prompts = prompts_for(b, args.prompt_len, engine.model_config.vocab_size)
            timed_ms(engine, prompts, 3)  # warm-up: allocator, caches
            steps0 = engine.stats.steps
            walls = timed_ms(engine, prompts, args.calls)
            steps = (engine.stats.steps - steps0) // args.calls
            text.write(f"{b:4d} prompts x {args.prompt_len}: median {statistics.median(walls):7.3f} ms, "
                       f"min {min(walls):7.3f} ms over {args.calls} calls ({steps} prefill step(s) a call, "
                       f"{'real' if args.real_forward else 'stub'} forward)\n")
        prompts = prompts_for(biggest, args.prompt_len, engine.model_config.vocab_size)
        text.write(phases_text(engine, prompts, args.calls))
        if not args.no_profile:
            text.write(profile_text(engine, prompts, args.profile_calls, args.top))
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text.getvalue())


if __name__ == "__main__":
    main()
