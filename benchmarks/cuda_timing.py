"""Timing of captured CUDA graphs, shared by the GPU benchmarks."""
from __future__ import annotations

import torch


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds per replay of `graph`, by CUDA events around `replays` back-to-back replays,
    after one replay that warms it up."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays
