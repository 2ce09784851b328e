"""Stand-in eager prefills of several requests, for the compile-ahead at start-up.

Why: a rollout starts with a `generate` of many prompts, whose prefill runs eagerly where no
prefill graph holds it (more tokens or requests than the largest graph, tp_size > 1, a backend
without extend graphs). Its kernels are mostly those of the decode and prefill graphs, but not
all: the launch configs of the skinny GEMMs go by row class (2-8, 9-16, 17-32, 33-64,
65-128, 129-256 rows; above them cuBLAS), and the variants of a class that no graph reaches (an
engine whose graphs stop at 8 requests, prefilling 24 prompt tokens) would compile at the first
`generate` that needs them, one at a time (0.3-2 s each on an H200 host; measured: a first
`generate` of 4 ragged prompts compiled the extend kernel, 0.48 s, docs/BENCHMARKS.md). So the
compile-ahead also runs one eager EXTEND forward of each class: `STAND_IN_TOKENS` tokens over as
many requests (at most the engine's), so that the LM head's rows (one a request) reach the
classes too.

A stand-in runs at start-up only, before any request exists: its rows are request rows 0.. and
its KV slots 1..n; a kernel whose variant is already in memory launches for real on them, and
the compile-ahead's caller zeroes the KV pool and req_to_token after (as for the graphs'
stand-ins)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from rollout.batch_builder import build_batch
from rollout.forward_batch import ForwardMode
from rollout.kv_allocator import KVAllocator

if TYPE_CHECKING:
    from rollout.model_runner import ModelRunner

# one token count in each row class of the skinny GEMMs' configs (gemv_launch) and one past them
STAND_IN_TOKENS = (2, 4, 7, 12, 24, 48, 96, 192, 300)


def stand_in_forwards(model_runner: "ModelRunner") -> list:
    """The stand-in prefills this engine can hold (prefill budget, KV slots, context length),
    as callables."""
    mr = model_runner
    limit = min(mr.config.prefill_token_budget(mr.model_config), mr.num_token_slots - 1)
    return [functools.partial(run_stand_in, mr, n) for n in STAND_IN_TOKENS
            if n <= limit and max(_lengths(mr, n)) <= mr.max_context_len]


def _lengths(model_runner: "ModelRunner", tokens: int) -> list[int]:
    """`tokens` over min(tokens, max requests) requests, as even as can be."""
    reqs = min(tokens, model_runner.config.max_running_requests)
    return [tokens // reqs + (i < tokens % reqs) for i in range(reqs)]


def run_stand_in(model_runner: "ModelRunner", tokens: int) -> None:
    """One eager prefill of `tokens` token-0 prompt tokens (`_lengths`); logits computed,
    nothing sampled."""
    mr = model_runner
    lens = _lengths(mr, tokens)
    reqs = len(lens)
    allocator = KVAllocator(reqs, tokens + 1, max(lens))  # slots 1..tokens, as the pool's
    fb = build_batch(ForwardMode.EXTEND, list(range(reqs)), [[0] * n for n in lens], [0] * reqs,
                     allocator, mr.device)
    fb.req_to_token_pool, fb.token_to_kv_pool = mr.req_to_token_pool, mr.token_to_kv_pool
    fb.attn_backend = mr.attn_backend
    mr.take_inputs(fb)
    mr.forward_eager(fb)


__all__ = ["STAND_IN_TOKENS", "stand_in_forwards", "run_stand_in"]
