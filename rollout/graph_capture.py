"""Capturing one CUDA graph, the way every graph of the engine is captured."""
from __future__ import annotations

from typing import Callable

import torch


def capture_graph(forward: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Runs `forward` twice outside the graph (Triton compiles, cuBLAS picks its kernels) on a
    side stream, as torch.cuda.graph requires, then captures it into `pool`; returns the graph
    and its static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out
