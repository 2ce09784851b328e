"""Timing of captured CUDA graphs and of whole `generate` calls, shared by the GPU benchmarks."""
from __future__ import annotations

import bisect
import cProfile
import io
import pstats
import time

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


def full_batch_graph(engine, batch: int, max_keys: int, required: bool = False):
    """The decode graph a step of all `batch` requests replays when the longest context has
    `max_keys` keys (its padded size, its launch class); None if not captured (`required`: a
    ValueError). Not the graph a call replayed last: with mixed steps the first prefill chunk's
    requests decode a step ahead of the second's, so a 128-request call of equal lengths ends
    on a step of 64 rows."""
    gr = engine.runner.graph_runner
    graph = None
    if gr is not None and gr.graphs and 0 < batch <= gr.max_bs:
        size = gr.batch_sizes[bisect.bisect_left(gr.batch_sizes, batch)]
        graph = gr.graphs.get((size, gr.backend.decode_launch_class(size, max_keys)))
    if graph is None and required:
        raise ValueError(f"no decode CUDA graph captured for {batch} requests")
    return graph


def generate_seconds(engine, prompts, params) -> float:
    """Wall seconds of one `engine.generate(prompts, params)`, the GPU idle at its start and
    done at its end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def generate_host_profile(engine, prompts, params, top: int) -> str:
    """cProfile's table (by own time, `top` rows) of one `engine.generate(prompts, params)`, the
    GPU done at its end: where the host's time goes (cProfile slows it ~2x)."""
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()
