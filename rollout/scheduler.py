"""Scheduler: the owner of requests. Each step it picks work, builds one ForwardBatch, has it
run, and applies the sampled tokens.

Policy: prefill first (FCFS admission while rows, the prefill-token budget and the KV pool
allow, keeping one free slot per running request for its next decode); otherwise decode every
running request. When the pool runs dry during decode, the newest request is retracted: its KV
is freed, its tokens kept, and it goes back to the head of the queue to be recomputed.

Mixed steps (`mixed=True`): an admission's EXTEND batch also carries the running requests'
next tokens (one token each after their cached KV), so the running requests do not wait a step
for each admission: in continuous batching, where the waiting requests are admitted a few at a
time as others finish, that is a decode step saved per admission.

Overlap (`overlap=True`, the default on a single GPU): each step first queues the next batch on
the device, its input ids taken on the device from the tokens the previous batch is still
sampling, and only then waits for the previous batch's tokens and applies them. The host's work
(scheduling, metadata, graph launch, bookkeeping) thus runs while the GPU computes. A request
that turns out to have finished (stop token) was queued once more: that row's result is dropped
and its KV freed when the step completes. Requests that finish on length are known ahead and
never queued again. Retraction, aborts and pauses first complete the step in flight (`drain`).

Prefix cache (`prefix_cache`, on by default): a request that leaves (finished or aborted) puts
its tokens' KV into the cache's tree instead of freeing it; an admitted request whose tokens
start with cached ones points its row at those slots and computes only the rest. Cached slots
that no request uses are evicted, least recently used first, when admission or a decode step
needs slots — before any request is retracted. Every weight change (`commit_weights`) empties
the tree of the old KV."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from rollout.batch_builder import build_batch, build_decode_batch
from rollout.forward_batch import ForwardBatch, ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.launched_step import HostSample, LaunchedStep
from rollout.prefix_cache import CacheNode, PrefixCache
from rollout.prompt_group import PromptGroup
from rollout.request import Request
from rollout.routing_record import RoutingReadback
from rollout.sampler import SampleOutput
from rollout.sampling_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

RunBatch = Callable[[ForwardBatch], SampleOutput]
EVICT_FRACTION = 64  # an eviction frees at least capacity / this (`make_room`)


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    retractions: int = 0
    aborted: int = 0
    dropped_rows: int = 0  # overlap: rows queued for a request that had finished meanwhile
    shared_prompt_tokens: int = 0  # prompt tokens admitted with their KV cached (prompt_group)
    mixed_decode_tokens: int = 0  # decode tokens computed in an admission's step (mixed steps)
    cached_prompt_tokens: int = 0  # tokens admitted with their KV found in the prefix cache
    evicted_tokens: int = 0  # prefix-cache slots freed for other work


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int
    max_prefill_tokens: int
    vocab_size: int
    eos_ids: frozenset[int]


class Scheduler:
    def __init__(self, allocator: KVAllocator, limits: SchedulerLimits, run_batch: RunBatch,
                 device: torch.device, overlap: bool = False, mixed: bool = False,
                 prefix_cache: bool = False, weights_epoch: Callable[[], int] = lambda: 0,
                 read_routing: Optional[Callable[[np.ndarray], RoutingReadback]] = None):
        self.alloc, self.limits, self.run_batch, self.device = allocator, limits, run_batch, device
        # a finished request's routing, read by its KV slots before they go (`routing_record`)
        self.read_routing = read_routing
        self.overlap, self.mixed = overlap, mixed
        # the runner's count of weight writes; with the commits of versions, what cached KV is
        # tagged with (a version may be pushed again, and weights may be written with none)
        self._weights_epoch, self._commits = weights_epoch, 0
        self.cache: Optional[PrefixCache] = PrefixCache(self.kv_epoch) if prefix_cache else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._weight_version = 0
        self._info_key: Optional[tuple[int, ...]] = None
        self._info: Optional[SamplingBatchInfo] = None
        self._inflight: Optional[LaunchedStep] = None
        self.finished_pending: list[Request] = []  # finished between steps, returned by the next step

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    @property
    def stuck(self) -> bool:
        """Requests wait but none runs or is in flight, so a step admitted nothing: the head of
        the queue cannot fit the whole KV pool (validation rules that out, so KV has leaked)."""
        return bool(self.waiting) and not self.running and self._inflight is None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def reset(self) -> list[Request]:
        """Drop every request, after the call that owns them failed or was abandoned: the step in
        flight is waited for (its kernels write KV slots), every row and slot is free again and
        nothing of that call reaches the next one. Returns the requests dropped (aborted)."""
        step, self._inflight = self._inflight, None
        if step is not None:
            try:
                step.wait()
            except Exception as e:  # noqa: BLE001 — the failure being cleaned up, most likely
                logger.warning("the step in flight failed while its call was dropped: %s", e)
        dropped = self.running + list(self.waiting)
        for req in dropped:
            if req.finish_reason is None:
                req.finish_reason = "abort"
            req.row, req.kv_allocated, req.shared_len, req.pending = None, 0, 0, 0
            req.cache_node, req.group_member, req.dup_slots = None, False, None
        self.running, self.waiting, self.finished_pending = [], deque(), []
        self._info_key, self._info = None, None
        self.alloc.reset()
        if self.cache is not None:
            self.cache.clear()  # its slots are free again with the rest
        return dropped

    # ---- weights and the prefix cache ----------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.commit_weights(version)

    def commit_weights(self, version: int) -> None:
        """New weights are in place as `version` (which may repeat the last one): the cached KV
        of the old ones goes (requests still running keep theirs: `in_place` updates)."""
        self._weight_version = version
        self._commits += 1
        self._check_cache_epoch()

    @property
    def kv_epoch(self) -> int:
        """Changes whenever the weights may have: with every write to them and every commit."""
        return self._weights_epoch() + self._commits

    def _check_cache_epoch(self) -> None:
        """The cached KV goes once the weights have changed (held entries turn stale)."""
        if self.cache is not None and self.cache.version != (epoch := self.kv_epoch):
            self.alloc.release(self.cache.invalidate(epoch))

    def drop_prefix_cache(self) -> None:
        """Every cached slot back to the pool (no request may be resident): the KV memory is
        being released, so what it holds will not survive."""
        if self.cache is not None:
            self.alloc.release(self.cache.clear())

    def make_room(self, num_slots: int) -> bool:
        """Evicts unused cached KV until `num_slots` slots are free, if it can; whether they are.
        An eviction frees at least 1/64 of the pool: it walks the whole tree, so a pool full of
        cached KV pays it once every many admissions, not at each."""
        short = num_slots - self.alloc.num_free_slots
        if short > 0 and self.cache is not None:
            freed = self.cache.evict(max(short, self.alloc.capacity // EVICT_FRACTION))
            self.alloc.release(freed)
            self.stats.evicted_tokens += len(freed)
        return num_slots <= self.alloc.num_free_slots

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished (and any aborted before). With
        overlap, the batch run here completes in the next call, after its successor is queued."""
        done, self.finished_pending = self.finished_pending, []
        prev, self._inflight = self._inflight, None
        if prev is None:
            launched = self._launch(prev=None)
            if self.overlap or launched is None:
                self._inflight = launched
                return done
            return done + self._complete(launched)
        self._inflight = self._launch(prev)  # queued behind prev on the device
        return done + self._complete(prev)

    def drain(self) -> None:
        """Complete the step in flight, if any (before a pause acts on the requests)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self.finished_pending.extend(self._complete(step))

    def _launch(self, prev: Optional[LaunchedStep]) -> Optional[LaunchedStep]:
        batch = self._admit(prev) or self._decode_batch(prev)
        if batch is None:
            return None
        reqs, fb = batch
        out = self.run_batch(fb)
        self.stats.steps += 1
        for r in reqs:
            r.pending += 1
        return LaunchedStep(reqs, out)

    def _admit(self, prev: Optional[LaunchedStep]) -> Optional[tuple[list[Request], ForwardBatch]]:
        """FCFS while rows, the prefill budget and the KV pool allow. A sample of a prompt whose
        KV is cached (or computed in this step) computes only what follows it (`prompt_group`).
        With `mixed`, the running requests' next tokens ride along (one token each after their
        cached KV, first in the batch): they do not wait for the admission's step."""
        picked, cached, hits, tokens = [], [], [], 0
        step, version, epoch = self.stats.steps, self.weight_version, self.kv_epoch
        self._check_cache_epoch()
        while self.waiting and len(self.running) + len(picked) < self.limits.max_running:
            req = self.waiting[0]
            group = req.group
            prefix = group.admission_prefix(step, version) if group is not None else 0
            follows, node = prefix > 0, None
            if not follows and self.cache is not None:
                node, prefix = self._match(req)
            need = req.length - prefix
            fits_budget = not picked or tokens + need <= self.limits.max_prefill_tokens
            reserve = len(self.running) + len(picked) + 1
            if (not fits_budget or self.alloc.num_free_rows == 0
                    or not self.make_room(tokens + need + reserve)):
                if node is not None:
                    self.alloc.release(self.cache.unlock(node))
                break
            req.row = self.alloc.alloc_row()
            if group is not None and not follows and group.vacant:
                group.reserve_lead(step, req.row)
            picked.append(self.waiting.popleft())
            cached.append(prefix)
            hits.append(node)
            req.kv_version, req.cached_tokens = epoch, prefix if node is not None else 0
            tokens += need
        if not picked:
            return None
        # their slots were reserved above: one per running request
        decoding = self._decoding() if self.mixed else []
        fb = self._build(ForwardMode.EXTEND, decoding + picked,
                         [[0 if r.pending else r.last_id] for r in decoding]
                         + [r.prefill_ids_from(p) for r, p in zip(picked, cached)],
                         [r.kv_len for r in decoding] + cached,
                         shared=self._shared_rows(picked, cached, hits, step))
        if prev is not None and decoding:
            _take_pending_inputs(fb, decoding, prev)  # one token a row: row i is token i
        self._share_prompts(picked, cached, hits, step, version)
        self.running.extend(picked)
        self.stats.prefill_tokens += tokens
        self.stats.decode_tokens += len(decoding)
        self.stats.mixed_decode_tokens += len(decoding)
        from_cache = sum(r.cached_tokens for r in picked)
        self.stats.cached_prompt_tokens += from_cache
        self.stats.shared_prompt_tokens += sum(cached) - from_cache
        return decoding + picked, fb

    def _match(self, req: Request) -> tuple[Optional[CacheNode], int]:
        """The cached prefix of what `req` must compute (all but its last token, whose logits it
        samples from), its node locked; (None, 0) when nothing is cached."""
        ids = req.prefill_ids
        node, n = self.cache.match(np.asarray(ids[:len(ids) - 1], dtype=np.int64))
        if n == 0:
            return None, 0
        self.cache.lock(node)
        return node, n

    def _decoding(self) -> list[Request]:
        """The running requests that still need a token (with overlap, one that ends on length
        with the token in flight is known ahead and not queued again)."""
        if self.overlap:
            return [r for r in self.running if not r.ends_by_length_when_applied]
        return list(self.running)

    def _shared_rows(self, picked: Sequence[Request], cached: Sequence[int],
                     hits: Sequence[Optional[CacheNode]],
                     step: int) -> Optional[list[tuple[int, int, int]]]:
        """(row, source row, n) for each request that starts with cached KV: its row's first n
        slots are the source row's once the batch has its slots — its group leader's in this
        step, else the prefix cache's or the group's held slots, which go into its own row here
        (`build_batch`'s `shared`)."""
        shared = []
        for req, prefix, node in zip(picked, cached, hits):
            if not prefix:
                continue
            group = req.group
            if node is not None:
                self.alloc.table[req.row, :prefix] = self.cache.path_slots(node)
                shared.append((req.row, req.row, prefix))
            elif group.lead_step == step:
                shared.append((req.row, group.lead_row, prefix))
            else:
                self.alloc.table[req.row, :prefix] = group.slots
                shared.append((req.row, req.row, prefix))
        return shared or None

    def _share_prompts(self, picked: Sequence[Request], cached: Sequence[int],
                       hits: Sequence[Optional[CacheNode]], step: int, version: int) -> None:
        """After the batch took its slots. Followers join their group: they hold its slots, not
        their own. With the prefix cache, what this step computes of every other request (all
        its tokens but the last) goes into the tree now, so later steps find it — a system
        prompt that a call's prompts share, across its admission steps — and the request holds
        that node. A leader hands its prompt's slots to its group (with the cache: the group
        holds the tree's node of the prompt, and owns the leader's duplicates). (A leader is
        picked before the followers of its step.)"""
        for req, prefix, node in zip(picked, cached, hits):
            group = req.group
            if group is not None and prefix and node is None:
                group.follow()
                if group.node is not None:
                    self.cache.lock(group.node)
                req.group_member, req.shared_len = True, group.prefix_len
                continue
            duplicates = self._cache_prefill(req, prefix, node) if self.cache is not None else None
            if (group is not None and group.vacant and group.lead_step == step
                    and group.lead_row == req.row):
                self._lead(req, group, version, duplicates)
            elif duplicates is not None and len(duplicates):
                req.dup_slots = duplicates

    def _cache_prefill(self, req: Request, cached: int, node: Optional[CacheNode]) -> np.ndarray:
        """Inserts the tokens `req` computes in this step (after `cached` from the tree) but its
        last; it holds the new node instead of `node`. Returns its own slots of tokens the tree
        had already (another request of this step computed them too)."""
        ids = req.prefill_ids
        n = len(ids) - 1
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        new, duplicates = self.cache.insert(np.asarray(ids[:n], dtype=np.int64),
                                            self.alloc.table[req.row, :n], own_from=cached)
        self.cache.lock(new)
        if node is not None:
            self.cache.unlock(node)  # a live node: frees nothing
        req.cache_node, req.shared_len = new, n
        return duplicates

    def _lead(self, req: Request, group: PromptGroup, version: int,
              duplicates: Optional[np.ndarray]) -> None:
        """`req` computed its group's prompt: the group takes the prompt's slots — or, with the
        cache, which took them already, holds the tree's node of the prompt and the leader's
        `duplicates` (slots in the followers' rows too)."""
        if self.cache is None:
            group.lead(self.alloc.table[req.row, :group.prefix_len].copy(), version)
        else:
            node, _ = self.cache.match(np.asarray(req.prompt_ids[:group.prefix_len], dtype=np.int64))
            self.cache.lock(node)
            group.lead(duplicates, version, node)
        req.group_member = True
        req.shared_len = max(req.shared_len, group.prefix_len)

    def _decode_batch(self, prev: Optional[LaunchedStep]) -> Optional[tuple[list[Request], ForwardBatch]]:
        """Every running request that still needs a token. Behind a step in flight (`prev`),
        a request's input id is the token prev is sampling for it; retraction then waits for
        prev to complete (None here), as it frees KV and keeps the request's tokens."""
        # Without overlap nothing is pending between steps, so no request ends by length unseen.
        reqs = self._decoding()
        if not self.make_room(len(reqs)):
            if prev is not None:
                return None
            while self.running and not self.make_room(len(self.running)):
                self._retract(self.running[-1])
            reqs = list(self.running)
        if not reqs:
            return None
        # host ints only: a pending request's input id is taken on the device below
        tokens = [0 if r.pending else r.last_id for r in reqs]
        key = tuple([r.rid for r in reqs])
        # the same requests as the last decode: its sampling tensors serve again, all but the
        # uniforms, which the batch's own copy brings
        same_rows = self._info if key == self._info_key else None
        fb = build_decode_batch([r.row for r in reqs], tokens, [r.kv_len for r in reqs], self.alloc,
                                self.device, sampling_info=same_rows)
        self._check_built(fb, reqs)
        if same_rows is None:
            fb.sampling_info = self._sampling_info(reqs, fb, key)
        if prev is not None:
            _take_pending_inputs(fb, reqs, prev)
        self.stats.decode_tokens += len(reqs)
        return reqs, fb

    def _build(self, mode: ForwardMode, reqs: Sequence[Request], tokens, prefix_lens,
               shared=None) -> ForwardBatch:
        fb = build_batch(mode, [r.row for r in reqs], tokens, prefix_lens, self.alloc, self.device,
                         shared=shared)
        self._check_built(fb, reqs)
        fb.sampling_info = self._sampling_info(reqs, fb, key=None)
        return fb

    @staticmethod
    def _check_built(fb: Optional[ForwardBatch], reqs: Sequence[Request]) -> None:
        if fb is None:  # admission and retraction keep enough slots free; reaching here is a bug
            raise RuntimeError("KV slots ran out after the scheduler reserved them")
        for r, n in zip(reqs, fb.seq_lens_cpu):
            r.kv_allocated = n

    def _sampling_info(self, reqs: Sequence[Request], fb: ForwardBatch,
                       key: Optional[tuple[int, ...]]) -> SamplingBatchInfo:
        """Fresh sampling tensors for fb's rows. The position of the token each row samples is
        its `seq_lens` entry (tokens in the KV cache after this step). `key`: a decode batch's
        request ids; the next decode of the same requests reuses every tensor but the uniforms."""
        self._info = SamplingBatchInfo.build([r.params for r in reqs], [r.seed for r in reqs],
                                             fb.seq_lens_cpu, self.limits.vocab_size, self.device)
        self._info_key = key
        return self._info

    def _complete(self, step: LaunchedStep) -> list[Request]:
        """Wait for a launched step's tokens and apply them; returns the requests it finished."""
        sample = step.wait()
        finished = []
        version, eos = self.weight_version, self.limits.eos_ids
        tops = sample.top_ids is not None
        for i, req in enumerate(step.reqs):
            req.pending -= 1
            if req.finish_reason is not None:  # finished or aborted after this step was queued:
                self.stats.dropped_rows += 1  # drop the row
            else:
                req.append(sample.tokens[i], sample.logprobs[i], version,
                           _top(sample, i, req) if tops else None)
                req.check_finished(eos)
                if req.finish_reason is not None:
                    finished.append(req)
            if req.finish_reason is not None and req.pending == 0 and req.row is not None:
                self._free_kv(req)
        if finished:  # one pass, not a list.remove per finished request
            self.running = [r for r in self.running if r.finish_reason is None]
        return finished

    # ---- retract / abort / release ------------------------------------------------------------
    def _retract(self, req: Request) -> None:
        self._release(req, cache_kv=False)  # it leaves for want of slots, or of these weights
        req.num_retractions += 1
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        logger.debug("retracted request %d (%d tokens)", req.rid, req.length)

    def _release(self, req: Request, cache_kv: bool = True) -> None:
        self.running.remove(req)
        self._free_kv(req, cache_kv)

    def _free_kv(self, req: Request, cache_kv: bool = True) -> None:
        """Gives back the request's row and slots: its own slots go into the prefix cache
        (`cache_kv`, when on and the KV is of the current weights) or back to the pool; its
        holds on cached and group slots end (the group's go back with its last holder)."""
        own, cache = req.shared_len, self.cache
        if self.read_routing is not None and req.finish_reason is not None:
            # every token fed through the model: the prompt and the outputs but the last
            fed = min(req.kv_allocated, req.length - 1)
            req.routed_experts = self.read_routing(self.alloc.table[req.row, :fed])
        self._check_cache_epoch()
        if cache_kv and cache is not None and req.kv_version == cache.version:
            # the KV of every token but the last applied one is computed by completed steps
            n = min(req.kv_allocated, req.length - 1)
            row = self.alloc.table[req.row]
            _, untaken = cache.insert(np.asarray(req.all_ids[:n], dtype=np.int64), row[:n],
                                      own_from=own)
            self.alloc.release(untaken)
            own = max(own, n)
        self.alloc.free(req.row, req.kv_allocated, start=own)
        if req.cache_node is not None:
            self.alloc.release(cache.unlock(req.cache_node))
        if req.group_member:  # the group's slots go back with its last holder
            group = req.group
            if group.node is not None:
                self.alloc.release(cache.unlock(group.node))
            slots = group.leave()
            if slots is not None:
                self.alloc.release(slots)
        if req.dup_slots is not None:
            self.alloc.release(req.dup_slots)
        req.row, req.kv_allocated, req.shared_len = None, 0, 0
        req.cache_node, req.group_member, req.dup_slots = None, False, None

    def retract_all(self) -> None:
        """Move every running request back to the queue (their KV is recomputed later)."""
        self.drain()
        for req in reversed(list(self.running)):
            self._retract(req)

    def abort(self, rid: int) -> Optional[Request]:
        for req in list(self.running) + list(self.waiting):
            if req.rid == rid:
                if req.row is not None:
                    self.drain()  # the step in flight may still write its KV slots
                return self._abort(req) if req.finish_reason is None else None
        return None

    def drop(self, rids: set[int]) -> int:
        """Ends the requests `rids` of a call that ended early (closed, or its caller gone) and
        forgets them: their KV goes (cached, when the prefix cache is on), nothing returns them.
        Returns how many it found unfinished."""
        mine = [r for r in list(self.running) + list(self.waiting) if r.rid in rids]
        if any(r.row is not None for r in mine):
            self.drain()  # the step in flight may still write their KV slots
        for req in mine:
            if req.finish_reason is None:
                self._abort(req)
        self.finished_pending = [r for r in self.finished_pending if r.rid not in rids]
        return len(mine)

    def abort_all(self) -> list[Request]:
        self.drain()
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


def _top(sample: HostSample, i: int, req: Request) -> Optional[list[tuple[int, float]]]:
    """Row i's top logprobs, cut to what the request asked for (None when it asked for none)."""
    if sample.top_ids is None or not req.params.logprobs:
        return None
    k = req.params.logprobs
    return list(zip(sample.top_ids[i][:k], sample.top_values[i][:k]))


def _take_pending_inputs(fb: ForwardBatch, reqs: Sequence[Request], prev: LaunchedStep) -> None:
    """Input ids of the requests whose last token prev is still sampling: copied on the device.
    `reqs` are fb's first rows, one token each (a decode batch, or the decoding rows a mixed
    admission starts with). In the steady state (a decode batch of the same requests in the
    same order, all pending) they are prev's tokens as they are: the runner takes them in
    (`ForwardBatch.input_ids_source`), a decode graph's input kernel with the rest of its
    inputs."""
    if (fb.forward_mode.is_decode and len(reqs) == len(prev.reqs)
            and all(a is b and a.pending for a, b in zip(reqs, prev.reqs))):
        fb.input_ids_source = prev.tokens
        return
    pairs = [(i, prev.row_of[r.rid]) for i, r in enumerate(reqs) if r.pending]
    if not pairs:
        return
    idx = torch.tensor(pairs, dtype=torch.int64).T
    if fb.input_ids.device.type == "cuda":
        idx = idx.pin_memory()
    dst, src = idx.to(fb.input_ids.device, non_blocking=True)
    fb.input_ids.index_copy_(0, dst, prev.tokens.index_select(0, src))
    fb.input_ids_copied_on_device = True
