"""Scheduler: the owner of requests. Each step it picks work, builds one ForwardBatch, has it
run, and applies the sampled tokens.

Policy: prefill first (FCFS admission while rows, the prefill-token budget and the KV pool
allow, keeping one free slot per running request for its next decode); otherwise decode every
running request. When the pool runs dry during decode, the newest request is retracted: its KV
is freed, its tokens kept, and it goes back to the head of the queue to be recomputed."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from rollout.batch_builder import build_batch
from rollout.forward_batch import ForwardBatch, ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.request import Request
from rollout.sampler import SampleOutput
from rollout.sampling_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

RunBatch = Callable[[ForwardBatch], SampleOutput]


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    retractions: int = 0
    aborted: int = 0


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int
    max_prefill_tokens: int
    vocab_size: int
    eos_ids: frozenset[int]


class Scheduler:
    def __init__(self, allocator: KVAllocator, limits: SchedulerLimits, run_batch: RunBatch,
                 device: torch.device):
        self.alloc, self.limits, self.run_batch, self.device = allocator, limits, run_batch, device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.weight_version = 0
        self._info_key: Optional[tuple[int, ...]] = None
        self._info: Optional[SamplingBatchInfo] = None
        self.finished_pending: list[Request] = []  # aborted between steps, returned by the next step

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it (and any aborted before)."""
        done, self.finished_pending = self.finished_pending, []
        batch = self._admit() or self._decode_batch()
        if batch is None:
            return done
        reqs, fb = batch
        out = self.run_batch(fb)
        self.stats.steps += 1
        return done + self._apply(reqs, out)

    def _admit(self) -> Optional[tuple[list[Request], ForwardBatch]]:
        picked, tokens = [], 0
        while self.waiting and len(self.running) + len(picked) < self.limits.max_running:
            req = self.waiting[0]
            need = req.length
            fits_budget = not picked or tokens + need <= self.limits.max_prefill_tokens
            reserve = len(self.running) + len(picked) + 1
            if not fits_budget or tokens + need + reserve > self.alloc.num_free_slots:
                break
            if self.alloc.num_free_rows == 0:
                break
            req.row = self.alloc.alloc_row()
            picked.append(self.waiting.popleft())
            tokens += need
        if not picked:
            return None
        fb = self._build(ForwardMode.EXTEND, picked, [r.all_ids for r in picked], [0] * len(picked))
        self.running.extend(picked)
        self.stats.prefill_tokens += tokens
        return picked, fb

    def _decode_batch(self) -> Optional[tuple[list[Request], ForwardBatch]]:
        while self.running and self.alloc.num_free_slots < len(self.running):
            self._retract(self.running[-1])
        if not self.running:
            return None
        reqs = list(self.running)
        fb = self._build(ForwardMode.DECODE, reqs, [[r.all_ids[-1]] for r in reqs],
                         [r.kv_len for r in reqs])
        self.stats.decode_tokens += len(reqs)
        return reqs, fb

    def _build(self, mode: ForwardMode, reqs: Sequence[Request], tokens, prefix_lens) -> ForwardBatch:
        info = self._sampling_info(mode, reqs)
        fb = build_batch(mode, [r.row for r in reqs], tokens, prefix_lens, self.alloc, self.device,
                         sampling_info=info)
        if fb is None:  # admission and retraction keep enough slots free; reaching here is a bug
            raise RuntimeError("KV slots ran out after the scheduler reserved them")
        return fb

    def _sampling_info(self, mode: ForwardMode, reqs: Sequence[Request]) -> SamplingBatchInfo:
        """Consecutive decodes of the same requests reuse the device tensors: each row's position
        moves on by one, everything else stays."""
        key = tuple(r.rid for r in reqs) if mode.is_decode else None
        if key is not None and key == self._info_key:
            self._info.positions += 1
            return self._info
        self._info = SamplingBatchInfo.build([r.params for r in reqs], [r.seed for r in reqs],
                                             [r.position for r in reqs], self.limits.vocab_size,
                                             self.device)
        self._info_key = key
        return self._info

    def _apply(self, reqs: list[Request], out: SampleOutput) -> list[Request]:
        # the step's one device-to-host copy (token ids are exact in float64)
        tokens, logprobs = torch.stack((out.tokens.double(), out.logprobs.double())).tolist()
        tokens = [int(t) for t in tokens]
        tops = _top_lists(out, reqs)
        finished = []
        for i, req in enumerate(reqs):
            req.append(tokens[i], logprobs[i], self.weight_version, tops[i] if tops else None)
            req.check_finished(self.limits.eos_ids)
            if req.finished:
                finished.append(req)
        for req in finished:
            self._release(req)
        return finished

    # ---- retract / abort / release ------------------------------------------------------------
    def _retract(self, req: Request) -> None:
        self._release(req)
        req.num_retractions += 1
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        logger.debug("retracted request %d (%d tokens)", req.rid, req.length)

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.alloc.free(req.row, req.kv_len)
        req.row = None

    def retract_all(self) -> None:
        """Move every running request back to the queue (their KV is recomputed later)."""
        for req in reversed(list(self.running)):
            self._retract(req)

    def abort(self, rid: int) -> Optional[Request]:
        for req in list(self.running) + list(self.waiting):
            if req.rid == rid:
                return self._abort(req)
        return None

    def abort_all(self) -> list[Request]:
        return [self._abort(r) for r in list(self.running) + list(self.waiting)]

    def _abort(self, req: Request) -> Request:
        if req.row is not None:
            self._release(req)
        else:
            self.waiting.remove(req)
        req.finish_reason = "abort"
        self.stats.aborted += 1
        self.finished_pending.append(req)
        return req


def _top_lists(out: SampleOutput, reqs: list[Request]) -> Optional[list[Optional[list[tuple[int, float]]]]]:
    if out.top_logprob_ids is None:
        return None
    ids, vals = out.top_logprob_ids.tolist(), out.top_logprob_values.tolist()
    # None for rows that asked for none, whatever the batch: their top_logprobs stay [].
    return [list(zip(ids[i][:r.params.logprobs], vals[i][:r.params.logprobs]))
            if r.params.logprobs else None for i, r in enumerate(reqs)]
