"""Engine: the single-process rollout engine (DESIGN.md §3). Requests in, samples out."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional, Sequence, Union

from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import SINGLE, TPGroup
from rollout.engine_weights import EngineWeightsMixin
import torch

from rollout.batch_builder import build_batch
from rollout import scoring
from rollout.call_board import CallBoard
from rollout.errors import EngineNotReadyError, InvalidRequestError, KVCacheBudgetError
from rollout.forward_batch import ForwardBatch, ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.memory import MEMORY_TAGS
from rollout.model_runner import ModelRunner
from rollout.outputs import GenerateOutput
from rollout.progress import progress_bar
from rollout.request import Request
from rollout.request_builder import (ParamsArg, Prompt, PromptLimits, RequestBuilder, check_prompt_list,
                                     optional_tokenizer)
from rollout.sampler import SampleOutput
from rollout.scheduler import Scheduler, SchedulerLimits
from rollout.step_gate import StepGate
from weight_sync.updater import WeightUpdater

logger = logging.getLogger(__name__)

ASYNC_CALLS = 512  # agenerate calls that can be in flight at once (each holds a waiting thread)
UPDATE_WAIT_S = 600.0  # a call arriving while a weight update loads waits this long for it

WEIGHTS_RELEASED = ("the weights were released by release_memory and are undefined after "
                    "resume_memory; push a full weight update")


class Engine(EngineWeightsMixin):
    def __init__(self, config: Optional[EngineConfig] = None, *, tp: TPGroup = SINGLE, **overrides: Any):
        config = config or EngineConfig(**overrides)
        if config.model_path is None:
            from rollout.tiny_model import default_tiny_model_dir
            config.model_path = str(default_tiny_model_dir())
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.runner = ModelRunner(self.model_config, config, tp)
        self.tokenizer = optional_tokenizer(config.model_path)
        self.scheduler = self._make_scheduler()
        limits = PromptLimits(self.model_config.vocab_size, self.runner.max_context_len,
                              self.runner.num_token_slots - 1)
        self._requests = RequestBuilder(limits, self.tokenizer, config.seed, config.share_prompt_kv)
        self._board = CallBoard()  # the calls in flight, sharing the scheduler
        self._async_pool: Optional[ThreadPoolExecutor] = None  # agenerate's threads
        self._weights_lock = threading.RLock()  # weight updates vs. release/resume of memory
        self.gate = StepGate()
        self._deferred_drops: set[int] = set()  # requests of calls ended early, still to drop
        self.updater = WeightUpdater(self.runner, check_finite=config.check_finite)

    def _make_scheduler(self) -> Scheduler:
        r, mc = self.runner, self.model_config
        alloc = KVAllocator(self.config.max_running_requests + 1, r.num_token_slots, r.max_context_len)
        limits = SchedulerLimits(self.config.max_running_requests, self.config.prefill_token_budget(mc),
                                 mc.vocab_size, frozenset(mc.eos_token_ids))
        overlap = self.config.overlap and r.tp.size == 1
        routing = r.token_to_kv_pool.routing
        return Scheduler(alloc, limits, self.run_batch, r.device, overlap=overlap,
                         mixed=self.config.mixed_steps, prefix_cache=self.config.prefix_cache,
                         weights_epoch=self._weights_epoch,
                         read_routing=routing.read if routing is not None else None)

    def _weights_epoch(self) -> int:
        return self.runner.weights_epoch if self.runner is not None else -1

    @property
    def stats(self):
        return self.scheduler.stats

    def run_batch(self, fb: ForwardBatch) -> SampleOutput:
        """One forward + sample: what the scheduler calls each step."""
        fb.logits_read_at_once = True  # sampled right here, before any other forward (any dtype)
        out = self.runner.sample_step_graph(fb)  # a small decode batch: the whole step one graph
        return out if out is not None else self.runner.sample(self.forward(fb), fb)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of one batch. A TP leader overrides this to send `fb` to its followers first."""
        return self.runner.forward(fb)

    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Last-token logits [len(prompts), vocab] (float32, CPU) of a fresh prefill of each
        prompt: what a trainer compares against its own model after a weight update."""
        self._check_ready(wait_for_update=True)
        check_prompt_list(prompts)
        ids = [self._requests.encode_checked(i, p) for i, p in enumerate(prompts)]
        with self._outside_calls("prefill_logits()"):
            return self._prefill_logits(ids)

    @contextlib.contextmanager
    def _outside_calls(self, what: str) -> Iterator[None]:
        """The engine with no generate call open, between two steps, still ready: a forward
        outside generation (`prefill_logits`, `score`); the CPU threads are given back after."""
        with self._board.exclusive(what):
            self._drop_deferred()
            with self.gate.step():
                self._check_ready()  # memory may have been released meanwhile
                try:
                    yield
                finally:
                    self.runner.release_cpu_threads()

    def _prefill_logits(self, ids: list[list[int]]) -> torch.Tensor:
        """One EXTEND batch of the prompts, its rows and slots given back whatever happens."""
        alloc = self.scheduler.alloc
        if len(ids) > alloc.num_free_rows:
            raise KVCacheBudgetError(f"{len(ids)} prompts at once; the engine has "
                                     f"{alloc.num_free_rows} request rows free")
        self.scheduler.make_room(sum(map(len, ids)))  # cached KV gives way
        rows = [alloc.alloc_row() for _ in ids]
        fb = None
        try:
            fb = build_batch(ForwardMode.EXTEND, rows, ids, [0] * len(ids), alloc, self.runner.device)
            if fb is None:
                raise KVCacheBudgetError("the KV cache has no room for these prompts right now")
            return self.forward(fb).float().cpu()
        finally:
            for r, p in zip(rows, ids):
                alloc.free(r, len(p) if fb is not None else 0)

    def score(self, sequences: Sequence[Prompt], start: Union[int, Sequence[int]] = 1,
              temperature: float = 1.0) -> list[list[float]]:
        """For each sequence (token ids, or a string with a tokenizer), log p(token i | tokens
        before it) under softmax(logits / temperature) over the full vocabulary — the quantity
        `GenerateOutput.logprobs` gives for sampled tokens — for i from `start` (one for all, or
        one per sequence; 1 ≤ start ≤ its length) to its end (`scoring.py`). Checked whole
        before any work; waits, like `prefill_logits`, until no generate call is open."""
        self._check_ready(wait_for_update=True)
        check_prompt_list(sequences)
        ids = [self._requests.encode_checked(i, s) for i, s in enumerate(sequences)]
        starts = scoring.checked_starts(start, [len(s) for s in ids])
        scoring.check_temperature(temperature)
        budget = min(self.config.prefill_token_budget(self.model_config),
                     max(1, scoring.LOGITS_BYTES // (4 * self.model_config.vocab_size)))
        with self._outside_calls("score()"):
            return scoring.score(ids, starts, float(temperature), self.scheduler.alloc,
                                 self.forward, self.runner.device, budget, self.scheduler.make_room)

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None, *,
                 progress: Optional[bool] = None, **unknown: Any) -> list[GenerateOutput]:
        """Samples for every prompt (× n), in input order: prompt i's samples are contiguous."""
        outs = list(self.generate_iter(prompts, sampling_params, progress=progress, **unknown))
        outs.sort(key=lambda o: (o.prompt_index, o.sample_index))
        return outs

    def generate_iter(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None, *,
                      progress: Optional[bool] = None, **unknown: Any) -> Iterator[GenerateOutput]:
        """Streaming form: yields each sample as soon as it finishes (`prompt_index` and
        `sample_index` say which it is). Validation happens before the first yield's work."""
        if unknown:
            raise InvalidRequestError(f"unknown generate() argument(s) {sorted(unknown)}")
        self._check_ready(wait_for_update=True)
        reqs = self._requests.build(prompts, sampling_params)
        return self._run(reqs, self.config.show_progress if progress is None else progress)

    async def agenerate(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None,
                        **kw: Any) -> list[GenerateOutput]:
        """asyncio form of generate(); the work runs in a worker thread of the engine's own pool,
        large enough that concurrent calls (an agent loop's trajectories) batch together rather
        than wait for a thread of asyncio's default pool (a few per core)."""
        if self._async_pool is None:
            self._async_pool = ThreadPoolExecutor(max_workers=ASYNC_CALLS, thread_name_prefix="engine-call")
        call = functools.partial(self.generate, prompts, sampling_params, **kw)
        return await asyncio.get_running_loop().run_in_executor(self._async_pool, call)

    def _run(self, reqs: list[Request], show: bool) -> Iterator[GenerateOutput]:
        """One call's requests, in the scheduler with those of every other call in flight
        (`call_board`): while it has no finished sample to yield, the call's thread runs steps
        for all of them, or waits for the thread that does. Each step runs inside the gate,
        serialized with a pause or an abort from another thread. If the call ends early — the
        caller closed (or dropped) the iterator — its unfinished requests are dropped with their
        KV; a step that raises fails every call in flight and drops all their requests, so
        nothing of them reaches a later call."""
        with self._board.call():
            self._check_ready()  # memory may have been released meanwhile
            self._drop_deferred()
            call, runner = self._board.open(reqs), self.runner
            complete = False
            try:
                with self.gate.exclusive():
                    self._check_ready()  # not fenced meanwhile: then its abort would miss these
                    for r in reqs:
                        self.scheduler.add(r)
                with progress_bar(len(reqs), show) as bar:
                    while (finished := self._board.take_or_drive(call)) != []:
                        if finished is None:
                            self._drive()
                            continue
                        runner.release_cpu_threads()  # the caller runs between yields
                        for req in finished:
                            bar.update(1)
                            yield self._output(req)
                complete = True
            finally:
                unfinished = self._board.close(call)
                if not complete and unfinished:
                    self._drop_requests(unfinished)
                runner.release_cpu_threads()

    def _drive(self) -> None:
        """One step for every call in flight (this thread holds the drive); its finished
        requests go to their calls. A step that raises fails them all and resets the scheduler."""
        try:
            with self.gate.step():
                self._drop_deferred()
                scheduler = self.scheduler
                if not (scheduler.has_work or scheduler.finished_pending):
                    raise RuntimeError("a generate call waits for requests the scheduler does "
                                       "not hold (a bug): the calls in flight are failed")
                finished = scheduler.step()
                if not finished and scheduler.stuck:
                    raise KVCacheBudgetError(_stuck_message(scheduler))
            self._board.deliver(finished)
        except BaseException as e:
            self._board.fail_all(e)
            self._reset_after_failure()
            raise
        finally:
            self._board.release_drive()

    def _reset_after_failure(self) -> None:
        with self.gate.exclusive():
            dropped = self.scheduler.reset()
        if dropped:
            logger.warning("a step failed: the %d unfinished request(s) of the calls in flight were "
                           "dropped with their KV", len(dropped))

    def _drop_requests(self, rids: set[int]) -> None:
        """A call's unfinished requests go, with their KV — at once, or, if this thread holds the
        gate (the call was dropped by a garbage collection inside a step or a pause), at the
        next step or call."""
        if self.gate.held_here:
            self._deferred_drops |= rids
            return
        with self.gate.exclusive():
            dropped = self.scheduler.drop(rids)
        if dropped:
            logger.warning("a generate call ended early (its iterator was closed): %d unfinished "
                           "request(s) dropped with their KV", dropped)

    def _drop_deferred(self) -> None:
        if self._deferred_drops:
            rids, self._deferred_drops = self._deferred_drops, set()
            with self.gate.exclusive():  # (nested inside a step's hold)
                self.scheduler.drop(rids)

    def _output(self, req: Request) -> GenerateOutput:
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer is not None else None
        return GenerateOutput.from_request(req, self.weight_version, text)

    def abort_all(self) -> int:
        """End every request this engine holds now, running or queued in its scheduler, from
        any thread: each comes back from its generate call with the tokens it has and
        finish_reason "abort" — how a caller with enough samples stops the rest without losing
        them (dynamic sampling, over-sampling, partial rollouts). A call still waiting for the
        engine is not touched. Returns how many requests were ended."""
        with self.gate.exclusive():
            return len(self.scheduler.abort_all())

    def abort(self, rid: int) -> bool:
        """End request `rid` (the scheduler's id) now: it returns with the tokens it has,
        finish_reason "abort". Safe from any thread: it runs between two steps. False if no
        unfinished request has that id."""
        with self.gate.exclusive():
            return self.scheduler.abort(rid) is not None

    def _check_ready(self, wait_for_update: bool = False) -> None:
        """Raises what keeps this engine from generating now. With `wait_for_update`, a weight
        update that is loading (a moment, not a fault) is waited for first, up to
        UPDATE_WAIT_S (only where no lock or gate is held)."""
        if wait_for_update and self.updater.loading:
            self.updater.wait_until_loaded(UPDATE_WAIT_S)
        if self.runner is None:
            raise EngineNotReadyError("this engine is shut down; create a new one")
        if self.runner.released:
            raise EngineNotReadyError(
                f"memory {sorted(self.runner.released)} is released (release_memory); call "
                f"resume_memory(tags={tuple(self.runner.released)}) before generating")
        if self.updater.incomplete_reason is not None:
            raise EngineNotReadyError(self.updater.incomplete_reason)

    # ---- memory release / resume (colocated training) ------------------------------------------
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the KV cache and/or the weights, e.g. while a colocated trainer needs the GPU.
        Waits for a running generate() to end; until resume_memory, generate() raises
        EngineNotReadyError. Released weights come back undefined, so from here on the engine
        refuses to generate until a full weight update lands (release → train → resume → push)."""
        with self._board.exclusive("release_memory()"), self._weights_lock:
            self._drop_deferred()
            self.runner.release_memory(tags)
            if "kv_cache" in self.runner.released:
                self.scheduler.drop_prefix_cache()  # its KV is gone
            if "weights" in self.runner.released:
                self.updater.mark_incomplete(WEIGHTS_RELEASED, log=False)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Re-allocate what release_memory freed (the KV cache zeroed; CUDA graphs re-captured)."""
        with self._board.exclusive("resume_memory()"), self._weights_lock:
            self.runner.resume_memory(tags)

    def shutdown(self) -> None:
        with self.gate.exclusive():
            self.scheduler.abort_all()
        self.runner = None  # frees weights and KV pools once no one else holds them
        if self._async_pool is not None:
            self._async_pool.shutdown(wait=False)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _stuck_message(scheduler: Scheduler) -> str:
    head = scheduler.waiting[0]
    return (f"request {head.rid} ({head.length} tokens) cannot be admitted: {scheduler.alloc.num_free_slots} "
            f"KV slots and {scheduler.alloc.num_free_rows} rows are free with nothing running "
            "(KV was lost on an earlier failure); the call's requests were dropped")
