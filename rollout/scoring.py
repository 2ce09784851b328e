"""Scoring: the log-probability of every token of given sequences under the engine's weights.

Why: RL loops need log-probabilities of tokens the engine did not sample right now — a
response scored by a reference policy (the KL penalty, with an engine holding the reference
weights), off-policy or replayed samples re-scored under the current weights (importance
weights), an evaluation's perplexity. `GenerateOutput.logprobs` gives them for sampled tokens
only; `Engine.score` gives the same quantity for any tokens: log p(token i | tokens < i) under
softmax(logits / T) over the full vocabulary.

The sequences are prefilled in steps of at most `budget` tokens, a long one in pieces after its
own earlier pieces' KV (a chunked prefill), several short ones in one step; each step keeps the
logits of every token (`return_all_logits`) and only the rows it scores leave the device."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from rollout.batch_builder import build_batch
from rollout.errors import InvalidRequestError, KVCacheBudgetError
from rollout.forward_batch import ForwardBatch, ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.sampling_params import MIN_TEMPERATURE

# a step's fp32 logits stay under this many bytes (a 152k vocabulary: ~1,700 tokens a step)
LOGITS_BYTES = 1 << 30


def checked_starts(start, lengths: Sequence[int]) -> list[int]:
    """One start per sequence (an int for all, or a list), each in [1, its length]."""
    if isinstance(start, bool):
        raise InvalidRequestError(f"start must be an int or a list of ints, got {start!r}")
    starts = [start] * len(lengths) if isinstance(start, int) else list(start) if isinstance(
        start, Sequence) else None
    if starts is None or len(starts) != len(lengths):
        raise InvalidRequestError(f"start must be an int or one int per sequence ({len(lengths)}), "
                                  f"got {start!r}")
    for i, (s, n) in enumerate(zip(starts, lengths)):
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= n:
            raise InvalidRequestError(f"start {s!r} of sequence {i} must be an int in [1, {n}] "
                                      "(token 0 has no context to be scored in)")
    return starts


def check_temperature(temperature) -> None:
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature < MIN_TEMPERATURE):
        raise InvalidRequestError(f"temperature must be a finite number >= {MIN_TEMPERATURE:g}, "
                                  f"got {temperature!r}")


@dataclass(frozen=True)
class Piece:
    seq: int  # which sequence
    begin: int  # its tokens begin..end-1, after its first `begin` tokens' KV
    end: int


def plan_steps(lengths: Sequence[int], budget: int, max_rows: int) -> list[list[Piece]]:
    """The sequences in order, cut into pieces packed into steps of at most `budget` tokens and
    `max_rows` sequences; a sequence's pieces go in consecutive steps, one a step."""
    steps: list[list[Piece]] = []
    step: list[Piece] = []
    used = 0
    for i, length in enumerate(lengths):
        begin = 0
        while begin < length:
            if used == budget or len(step) == max_rows:
                steps.append(step)
                step, used = [], 0
            end = min(length, begin + budget - used)
            step.append(Piece(i, begin, end))
            used += end - begin
            begin = end
    if step:
        steps.append(step)
    return steps


def score(ids: Sequence[Sequence[int]], starts: Sequence[int], temperature: float,
          alloc: KVAllocator, forward: Callable[[ForwardBatch], torch.Tensor],
          device: torch.device, budget: int, make_room: Callable[[int], bool]) -> list[list[float]]:
    """For each sequence, the log-probabilities of its tokens from `starts[i]` on. Rows and KV
    slots come from `alloc` and all go back, whatever happens."""
    out: list[list[float]] = [[] for _ in ids]
    rows: dict[int, tuple[int, int]] = {}  # sequence -> (its row, the tokens its KV holds)
    try:
        for step in plan_steps([len(s) for s in ids], budget, max(1, alloc.num_free_rows - 1)):
            make_room(sum(p.end - p.begin for p in step))
            for p in step:
                if p.begin == 0:
                    rows[p.seq] = (alloc.alloc_row(), 0)
            fb = build_batch(ForwardMode.EXTEND, [rows[p.seq][0] for p in step],
                             [ids[p.seq][p.begin:p.end] for p in step], [p.begin for p in step],
                             alloc, device, return_all_logits=True)
            if fb is None:
                raise KVCacheBudgetError("the KV cache has no room to score these sequences now")
            for p in step:
                rows[p.seq] = (rows[p.seq][0], p.end)
            _score_step(step, ids, starts, temperature, forward(fb), out)
            for p in step:
                if p.end == len(ids[p.seq]):
                    row, held = rows.pop(p.seq)
                    alloc.free(row, held)
    finally:
        for row, held in rows.values():
            alloc.free(row, held)
    return out


def _score_step(step: Sequence[Piece], ids, starts, temperature: float, logits: torch.Tensor,
                out: list[list[float]]) -> None:
    """The logits row of token p predicts token p + 1: scored where p + 1 ≥ the start."""
    picks, targets, counts, offset = [], [], [], 0
    for p in step:
        seq = ids[p.seq]
        lo, hi = max(p.begin, starts[p.seq] - 1), min(p.end, len(seq) - 1)
        n = max(0, hi - lo)
        picks.append(np.arange(offset + lo - p.begin, offset + lo - p.begin + n))
        targets.append(np.asarray(seq[lo + 1:lo + 1 + n], dtype=np.int64))
        counts.append(n)
        offset += p.end - p.begin
    if not sum(counts):
        return
    pick = torch.from_numpy(np.concatenate(picks)).to(logits.device)
    target = torch.from_numpy(np.concatenate(targets)).to(logits.device)
    scaled = logits.index_select(0, pick).float() / temperature
    logprobs = scaled.log_softmax(-1).gather(1, target[:, None])[:, 0].tolist()
    at = 0
    for p, n in zip(step, counts):
        out[p.seq].extend(logprobs[at:at + n])
        at += n
