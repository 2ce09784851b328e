"""RolloutController: data-parallel replicas behind the same `generate` as `Engine.generate`.

It checks the model and the cluster before creating anything, creates `num_replicas` replicas
(each a TP group on one node, spread over nodes), and splits each generate call over them by
least outstanding work, with all `n` samples of a prompt on one replica. One Ray call per
replica per generate; the replicas' leaders run every step themselves.

Seeds: a prompt without a seed gets one here, from `random.Random(config.seed)` drawn exactly as
a single Engine draws it (rollout.request_builder.resolve_seed), so the controller's outputs
equal one Engine's for the same config and calls, whatever the number of replicas.

A replica whose shard dies mid-call is rebuilt and its prompts re-run elsewhere (actors/recovery.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import ray

from actors import cluster
from actors.controller_weights import ControllerWeightsMixin
from actors.health import replica_status, replica_status_unavailable
from actors.placement import bundle_resource, node_capacities, plan_replica_nodes
from actors.prefix_routing import PrefixRouter
from actors.recovery import ALIVE, REBUILDING, RecoveryMixin
from actors.replica import Replica, check_tp_size
from rollout.config import EngineConfig, ModelConfig
from rollout.errors import ConfigError, EngineNotReadyError, InvalidRequestError, RolloutError
from rollout.memory import MEMORY_TAGS, check_memory_tags
from rollout.outputs import GenerateOutput
from rollout.request_builder import ParamsArg, Prompt, check_prompt_list, params_list, resolve_seed
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
REBUILD_JOIN_S = 30.0  # shutdown waits this long for a replica being rebuilt


@dataclass
class _Part:
    """The prompts of one generate call that go to one replica."""

    replica: int
    indices: list[int] = field(default_factory=list)  # global prompt index of each prompt
    cost: int = 0
    attempt: int = 0  # > 0: a re-run after its replica failed


@dataclass
class _Call:
    """One generate call in flight: its inputs, what came back so far, and its future."""

    prompts: Sequence[Prompt]
    params: list[SamplingParams]
    progress: Optional[bool]
    left: int = 0
    outs: list[GenerateOutput] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    result: Future = field(default_factory=Future)


def work_estimate(prompt: Prompt, sp: SamplingParams, shared: bool = True) -> int:
    """Tokens a prompt may cost its replica: its prefill — once, and a token for each other
    sample, where its samples share the prompt's KV (`shared`, rollout.prompt_group) — and
    n × max new tokens."""
    prefill = len(prompt) + sp.n - 1 if shared else sp.n * len(prompt)
    return prefill + sp.n * sp.max_new_tokens


def prompt_key(prompt: Prompt) -> Union[str, tuple[int, ...]]:
    """What tells copies of a prompt apart from other prompts (its text, or its ids)."""
    return prompt if isinstance(prompt, str) else tuple(prompt)


class RolloutController(ControllerWeightsMixin, RecoveryMixin):
    def __init__(self, config: Optional[EngineConfig] = None, num_replicas: int = 1, *,
                 address: Optional[str] = None, placement_timeout_s: float = 60.0,
                 start_timeout_s: float = 600.0, dist_timeout_s: float = 120.0, **overrides: Any):
        self.config = _resolved(config or EngineConfig(**overrides))
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        self.model_config = ModelConfig.from_pretrained(self.config.model_path)
        check_tp_size(self.model_config, self.config.tp_size)
        self._owns_ray = cluster.connect(address, min_cpus=num_replicas * self.config.tp_size)
        self.replicas: list[Replica] = []
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # replica state changes (recovery)
        self._weights_lock = threading.RLock()  # weight updates, memory release, a rebuild's catch-up
        self._rng = random.Random(self.config.seed)
        self._outstanding = [0] * num_replicas
        self._state = [ALIVE] * num_replicas  # alive | rebuilding | stale | dead (actors/recovery.py)
        self._restarts = [0] * num_replicas
        self._last_failure: list[Optional[str]] = [None] * num_replicas
        self._recovery_threads: list[threading.Thread] = []
        self._weight_version = 0
        self._weights_updated = False  # has any update landed (else the checkpoint is the latest)
        self._released: set[str] = set()  # memory tags released on every replica
        # where each replica's prefix cache should hold a prompt's start (None: caches off)
        self._router = PrefixRouter() if self.config.prefix_cache else None
        self._placement_timeout_s, self._start_timeout_s = placement_timeout_s, start_timeout_s
        self._dist_timeout_s = dist_timeout_s
        self._closed = False
        try:
            self._start_replicas(num_replicas)
        except BaseException:
            self.shutdown()
            raise

    def _start_replicas(self, num: int) -> None:
        resource = bundle_resource(self.config)
        plan = plan_replica_nodes(num, self.config.tp_size, resource, node_capacities(resource))
        for i, node in enumerate(plan):
            self.replicas.append(Replica(i, self.config, node, placement_timeout_s=self._placement_timeout_s,
                                         dist_timeout_s=self._dist_timeout_s))
        for replica in self.replicas:  # they load in parallel; this only waits
            replica.wait_ready(self._start_timeout_s)
        logger.info("%d replica(s) of tp_size=%d ready", num, self.config.tp_size)

    @property
    def num_replicas(self) -> int:
        return len(self._outstanding)

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None, *,
                 progress: Optional[bool] = None, **unknown: Any) -> list[GenerateOutput]:
        """Same arguments and outputs as Engine.generate: every prompt's samples, in input
        order (prompt i's n samples contiguous, `prompt_index` = i)."""
        return self.generate_async(prompts, sampling_params, progress=progress, **unknown).result()

    def generate_async(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None, *,
                       progress: Optional[bool] = None, **unknown: Any) -> "Future[list[GenerateOutput]]":
        """Dispatch now, return at once: a concurrent.futures.Future of generate()'s list.
        Arguments are checked and seeds drawn before it returns (so call order fixes seeds)."""
        self._check_open()
        if unknown:
            raise InvalidRequestError(f"unknown generate() argument(s) {sorted(unknown)}")
        if self._released:
            raise EngineNotReadyError(f"memory {sorted(self._released)} is released (release_memory); "
                                      f"call resume_memory(tags={tuple(sorted(self._released))}) first")
        check_prompt_list(prompts)
        params = self._seeded(params_list(sampling_params, len(prompts), self.model_config.vocab_size))
        call = _Call(prompts, params, progress)
        parts = self._assign(prompts, params)
        call.left = len(parts)
        for part in parts:
            self._dispatch(call, part)
        return call.result

    async def agenerate(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None,
                        **kw: Any) -> list[GenerateOutput]:
        """asyncio form of generate()."""
        return await asyncio.wrap_future(self.generate_async(prompts, sampling_params, **kw))

    def _seeded(self, params: list[SamplingParams]) -> list[SamplingParams]:
        with self._lock:
            return [dataclasses.replace(sp, seed=resolve_seed(sp, self._rng)) for sp in params]

    def _assign(self, prompts: Sequence[Prompt], params: list[SamplingParams]) -> list[_Part]:
        """Each prompt (with all its n samples) to the alive replica with the least outstanding
        work once the prompt's own is added — less, on the replica whose prefix cache should
        hold its start (`PrefixRouter`: a conversation's next turn) — waiting while every
        replica is being rebuilt; with shared prompt KV, a copy of a prompt to the replica of
        its first copy, where its samples join theirs."""
        shared = self.config.share_prompt_kv
        while True:
            self._pick_alive()
            with self._lock:
                alive = [i for i, s in enumerate(self._state) if s == ALIVE]
                if not alive:  # one failed just now: wait again
                    continue
                load, parts, homes = list(self._outstanding), {}, {}
                for i, (prompt, sp) in enumerate(zip(prompts, params)):
                    key = prompt_key(prompt) if shared else i
                    r = homes.get(key)
                    if r is None:
                        cost = work_estimate(prompt, sp, shared)
                        home, saved = self._router.match(prompt) if self._router else (-1, 0)
                        r = homes[key] = min(alive, key=lambda j: load[j] - saved * (j == home))
                        cost -= saved * (r == home)
                    else:  # a copy: its samples follow the first copy's prefill there
                        cost = sp.n * (1 + sp.max_new_tokens)
                    load[r] += cost
                    part = parts.setdefault(r, _Part(r))
                    part.indices.append(i)
                    part.cost += cost
                for part in parts.values():
                    self._outstanding[part.replica] += part.cost
                return list(parts.values())

    def _record_route(self, prompt: Prompt, out: GenerateOutput, replica: int) -> None:
        """The replica now caches the sample's KV: the router remembers it there."""
        if self._router is not None:
            self._router.record(prompt, out.text if isinstance(prompt, str) else out.token_ids,
                                replica)

    def _dispatch(self, call: _Call, part: _Part) -> None:
        """One Ray call for the part (its cost is booked already); the outcome comes back to
        `_on_part_done`."""
        try:
            ref = self.replicas[part.replica].generate(
                [call.prompts[i] for i in part.indices], [call.params[i] for i in part.indices],
                progress=call.progress)
        except Exception as e:  # noqa: BLE001 — e.g. the replica was torn down just now
            failed: Future = Future()
            failed.set_exception(e)
            self._on_part_done(call, part, failed)
            return
        ref.future().add_done_callback(lambda fut: self._on_part_done(call, part, fut))

    def _on_part_done(self, call: _Call, part: _Part, fut: Future) -> None:
        err = fut.exception()
        if err is not None and not isinstance(err, RolloutError) and not self._closed:
            # maybe a dead shard: probing and re-running are blocking Ray calls, so not on Ray's
            # callback thread
            threading.Thread(target=self._recover_part, args=(call, part, err), daemon=True,
                             name=f"recover-part-{part.replica}").start()
            return
        self._settle(call, part, err, None if err is not None else fut.result())

    def _settle(self, call: _Call, part: _Part, err: Optional[BaseException],
                outs: Optional[list[GenerateOutput]]) -> None:
        """Book a finished part; the call's future resolves when every part is back (so the
        books are settled when the caller sees it): outputs in input order, or the first error."""
        with self._lock:  # resolve `call.result` outside the lock
            self._outstanding[part.replica] -= part.cost
            call.left -= 1
            if err is not None:
                call.errors.append(err)
            else:
                for o in _reindexed(outs, part.indices):
                    o.rerun_after_failure = part.attempt > 0
                    call.outs.append(o)
                    self._record_route(call.prompts[o.prompt_index], o, part.replica)
            if call.left:
                return
        if call.errors:
            call.result.set_exception(call.errors[0])
        else:
            call.result.set_result(sorted(call.outs, key=lambda o: (o.prompt_index, o.sample_index)))

    def abort_all(self) -> int:
        """End every request the replicas hold now (`Engine.abort_all` on each leader): the
        generate calls in flight return at once, their unfinished samples with the tokens they
        have and finish_reason "abort". Returns how many requests were ended."""
        self._check_open()
        refs: dict[int, ray.ObjectRef] = {}

        def call(replica):
            refs[replica.index] = replica.leader.abort_all.remote()
            return refs[replica.index]

        ended, failed = self._gather(self._serving_replicas(), call, "abort_all")
        if failed:
            raise failed[0][1]
        return sum(ray.get(refs[r.index]) for r in ended)

    def score(self, sequences: Sequence[Prompt], start: Union[int, Sequence[int]] = 1,
              temperature: float = 1.0) -> list[list[float]]:
        """`Engine.score` over the alive replicas: the sequences in contiguous shares of about
        equal tokens, one Ray call a replica, results in input order. Nothing is re-run: a
        replica that fails meanwhile fails the call (scoring changes no state; call again)."""
        check_prompt_list(sequences)
        starts = start if isinstance(start, int) else list(start)
        if not isinstance(starts, int) and len(starts) != len(sequences):
            raise InvalidRequestError(f"start must be an int or one int per sequence "
                                      f"({len(sequences)}), got {start!r}")
        with self._lock:
            alive = [r for r, s in zip(self.replicas, self._state) if s == ALIVE]
        if not alive:
            raise EngineNotReadyError("no replica is alive to score on")
        shares = _shares([len(s) for s in sequences], len(alive))
        refs = [replica.leader.score.remote(
                    [sequences[i] for i in share],
                    starts if isinstance(starts, int) else [starts[i] for i in share], temperature)
                for replica, share in zip(alive, shares) if share]
        return [lps for part in ray.get(refs) for lps in part]

    def prefill_logits(self, prompts: Sequence[Sequence[int]], replica: int = 0):
        """Last-token logits of a fresh prefill on one replica (see Engine.prefill_logits)."""
        return ray.get(self.replicas[replica].leader.prefill_logits.remote(prompts))

    # ---- memory release / resume (colocated training) -----------------------------------------
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Engine.release_memory on every shard: leaders first (each waits for its generation,
        then refuses work), then followers. generate() raises EngineNotReadyError until
        resume_memory; released weights also need a full weight update after it."""
        tags = check_memory_tags(tags)
        with self._weights_lock:
            self._release_on(self._serving_replicas(), tags)
            self._released.update(tags)
            if self._router is not None and "kv_cache" in tags:
                with self._lock:
                    self._router.clear()  # the replicas' caches went with their KV

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Followers first, then leaders (a leader may generate as soon as it is resumed)."""
        tags = check_memory_tags(tags)
        with self._weights_lock:
            replicas = self._serving_replicas()
            ray.get([s.resume_memory.remote(tags) for r in replicas for s in r.shards[1:]])
            ray.get([r.leader.resume_memory.remote(tags) for r in replicas])
            self._released.difference_update(tags)

    def _release_on(self, replicas: list[Replica], tags: Sequence[str]) -> None:
        ray.get([r.leader.release_memory.remote(tags) for r in replicas])
        ray.get([s.release_memory.remote(tags) for r in replicas for s in r.shards[1:]])

    # ---- health and teardown ----------------------------------------------------------------
    def status(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """One record per replica: index, node_id, tp_size, alive, outstanding_work, shards,
        error, and the recovery view: state (alive | rebuilding | stale | dead), restarts and
        last_failure. `alive` is true only for a replica in state alive whose shards all answer."""
        with self._lock:
            rows = list(zip(self.replicas, self._outstanding, self._state, self._restarts,
                            self._last_failure))
        out = []
        for replica, load, state, restarts, failure in rows:
            if state == REBUILDING:
                record = replica_status_unavailable(replica, load, "being rebuilt")
            else:
                record = replica_status(replica, load, timeout_s)
            record.update(state=state, restarts=restarts, last_failure=failure,
                          alive=record["alive"] and state == ALIVE)
            out.append(record)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise EngineNotReadyError("this RolloutController is shut down; create a new one")

    def shutdown(self) -> None:
        """Destroy every replica (shards killed, placement groups removed). Idempotent. If this
        controller started Ray itself it stops it too (so start Ray first, e.g. with
        actors.cluster.connect(), when several controllers share one session)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
            rebuilds = list(self._recovery_threads)
        for thread in rebuilds:  # a rebuild that finishes now destroys what it made
            thread.join(timeout=REBUILD_JOIN_S)
        self._close_push_channels()
        for replica in self.replicas:
            replica.destroy()
        self.replicas = []
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "RolloutController":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _resolved(config: EngineConfig) -> EngineConfig:
    """The config with its model path made explicit (every shard must load the same model)."""
    if config.model_path is not None:
        return config
    from rollout.tiny_model import default_tiny_model_dir
    return dataclasses.replace(config, model_path=str(default_tiny_model_dir()))


def _shares(lengths: list[int], parts: int) -> list[range]:
    """Contiguous index ranges of about equal total length, one per part (some may be empty)."""
    total, bounds, acc, i = sum(lengths), [0], 0, 0
    for k in range(1, parts):
        while i < len(lengths) and acc + lengths[i] <= total * k / parts:
            acc += lengths[i]
            i += 1
        bounds.append(i)
    bounds.append(len(lengths))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _reindexed(outs: list[GenerateOutput], indices: list[int]) -> list[GenerateOutput]:
    for o in outs:
        o.prompt_index = indices[o.prompt_index]
    return outs
