"""The fused sampler alone at Qwen2's vocabulary: µs a call for each launch shape
(`triton_sampler.SamplerLaunch`), side by side in one run, and whether each draws the default
launch's tokens.

Each launch's two kernels are captured 20 times in a row into one CUDA graph (under PDL, as in
the engine), over bf16 logits of the batch's size with random temperatures and uniforms; the
graph is replayed and timed by CUDA events (benchmarks/cuda_timing.py).

  python benchmarks/gpu_sampler.py --out $OUT/sampler.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.cuda_timing import replay_seconds
from rollout import triton_sampler
from rollout.triton_sampler import SamplerLaunch

VOCAB = 151936
LAUNCHES = [SamplerLaunch(1, 8, 8), SamplerLaunch(2, 8, 8), SamplerLaunch(4, 8, 8),
            SamplerLaunch(8, 8, 8), SamplerLaunch(4, 4, 8), SamplerLaunch(4, 16, 8),
            SamplerLaunch(1, 8, 4), SamplerLaunch(1, 8, 2), SamplerLaunch(4, 8, 4)]
CALLS_A_GRAPH = 20


def inputs(rows: int, unit_temperature: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    temps = torch.rand(rows, device="cuda", generator=gen) + 0.5
    if unit_temperature:  # the decode benchmark's T = 1: the kernels skip the division
        temps = torch.ones_like(temps)
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    uniforms = torch.rand(rows, device="cuda", generator=gen, dtype=torch.float64)
    return logits, temps, greedy, uniforms


def time_launch(args: tuple[torch.Tensor, ...], launch: SamplerLaunch,
                unit_temperature: bool = False) -> tuple[float, torch.Tensor]:
    """(µs a call, the tokens drawn)."""
    kw = {"launch": launch, "unit_temperature": unit_temperature}
    tokens = triton_sampler.sample_unfiltered(*args, **kw)[0]  # compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS_A_GRAPH):
            triton_sampler.sample_unfiltered(*args, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    return replay_seconds(graph, 20) / CALLS_A_GRAPH * 1e6, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--launches", nargs="*", default=None,
                   help="CHUNKS,STATS_WARPS,PICK_WARPS each (default: the list above)")
    p.add_argument("--unit-temperature", action="store_true",
                   help="every row at T = 1, the kernels told so (the engine's T = 1 shortcut)")
    p.add_argument("--out", default="sampler.json")
    args = p.parse_args()
    launches = ([SamplerLaunch(*map(int, s.split(","))) for s in args.launches]
                if args.launches else LAUNCHES)
    result = []
    for rows in args.rows:
        data = inputs(rows, args.unit_temperature)
        reference = None
        for launch in launches:
            us, tokens = time_launch(data, launch, args.unit_temperature)
            reference = tokens if reference is None else reference
            row = {"rows": rows, "launch": launch._asdict(), "us_a_call": round(us, 2),
                   "same_tokens_as_first": int((tokens == reference).sum()), "of": rows}
            result.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
