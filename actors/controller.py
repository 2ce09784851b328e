"""RolloutController: data-parallel replicas behind the same `generate` as `Engine.generate`.

It checks the model and the cluster before creating anything, creates `num_replicas` replicas
(each a TP group on one node, spread over nodes), and splits each generate call over them by
least outstanding work, with all `n` samples of a prompt on one replica. One Ray call per
replica per generate; the replicas' leaders run every step themselves.

Seeds: a prompt without a seed gets one here, from `random.Random(config.seed)` drawn exactly as
a single Engine draws it (rollout.request_builder.resolve_seed), so the controller's outputs
equal one Engine's for the same config and calls, whatever the number of replicas."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import ray

from actors import cluster
from actors.controller_weights import ControllerWeightsMixin
from actors.health import replica_status
from actors.placement import bundle_resource, node_capacities, plan_replica_nodes
from actors.replica import Replica, check_tp_size
from rollout.config import EngineConfig, ModelConfig
from rollout.errors import ConfigError, EngineNotReadyError, InvalidRequestError
from rollout.outputs import GenerateOutput
from rollout.request_builder import ParamsArg, Prompt, check_prompt_list, params_list, resolve_seed
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Part:
    """The prompts of one generate call that go to one replica."""

    replica: int
    indices: list[int] = field(default_factory=list)  # global prompt index of each prompt
    cost: int = 0


def work_estimate(prompt: Prompt, sp: SamplingParams) -> int:
    """Tokens a prompt may cost its replica: n × (prompt + max new tokens)."""
    return sp.n * (len(prompt) + sp.max_new_tokens)


class RolloutController(ControllerWeightsMixin):
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
        self._rng = random.Random(self.config.seed)
        self._outstanding = [0] * num_replicas
        self._weight_version = 0
        self._closed = False
        try:
            self._start_replicas(num_replicas, placement_timeout_s, start_timeout_s, dist_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start_replicas(self, num: int, placement_s: float, start_s: float, dist_s: float) -> None:
        resource = bundle_resource(self.config)
        plan = plan_replica_nodes(num, self.config.tp_size, resource, node_capacities(resource))
        for i, node in enumerate(plan):
            self.replicas.append(Replica(i, self.config, node, placement_timeout_s=placement_s,
                                         dist_timeout_s=dist_s))
        for replica in self.replicas:  # they load in parallel; this only waits
            replica.wait_ready(start_s)
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
        check_prompt_list(prompts)
        params = self._seeded(params_list(sampling_params, len(prompts)))
        parts = self._assign(prompts, params)
        refs = [self.replicas[p.replica].generate([prompts[i] for i in p.indices],
                                                  [params[i] for i in p.indices], progress=progress)
                for p in parts]
        return self._gather(parts, refs)

    async def agenerate(self, prompts: Sequence[Prompt], sampling_params: ParamsArg = None,
                        **kw: Any) -> list[GenerateOutput]:
        """asyncio form of generate()."""
        return await asyncio.wrap_future(self.generate_async(prompts, sampling_params, **kw))

    def _seeded(self, params: list[SamplingParams]) -> list[SamplingParams]:
        with self._lock:
            return [dataclasses.replace(sp, seed=resolve_seed(sp, self._rng)) for sp in params]

    def _assign(self, prompts: Sequence[Prompt], params: list[SamplingParams]) -> list[_Part]:
        """Each prompt (with all its n samples) to the replica with the least outstanding work."""
        with self._lock:
            load, parts = list(self._outstanding), {}
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                r = min(range(len(load)), key=load.__getitem__)
                cost = work_estimate(prompt, sp)
                load[r] += cost
                part = parts.setdefault(r, _Part(r))
                part.indices.append(i)
                part.cost += cost
            for part in parts.values():
                self._outstanding[part.replica] += part.cost
            return list(parts.values())

    def _gather(self, parts: list[_Part], refs: list[ray.ObjectRef]) -> "Future[list[GenerateOutput]]":
        """One future for the whole call, resolved when every part is back (so the books are
        settled when the caller sees it): the outputs in input order, or the first error."""
        result: Future = Future()
        outs: list[GenerateOutput] = []
        errors: list[BaseException] = []
        left = [len(parts)]

        def on_done(part: _Part, fut: Future) -> None:
            with self._lock:  # settle the books; resolve `result` outside the lock
                self._outstanding[part.replica] -= part.cost
                left[0] -= 1
                if fut.exception() is not None:
                    errors.append(fut.exception())
                else:
                    outs.extend(_reindexed(fut.result(), part.indices))
                if left[0]:
                    return
            if errors:
                result.set_exception(errors[0])
            else:
                result.set_result(sorted(outs, key=lambda o: (o.prompt_index, o.sample_index)))

        for part, ref in zip(parts, refs):
            ref.future().add_done_callback(lambda f, part=part: on_done(part, f))
        return result

    def prefill_logits(self, prompts: Sequence[Sequence[int]], replica: int = 0):
        """Last-token logits of a fresh prefill on one replica (see Engine.prefill_logits)."""
        return ray.get(self.replicas[replica].leader.prefill_logits.remote(prompts))

    # ---- health and teardown ----------------------------------------------------------------
    def status(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """One record per replica: index, node_id, tp_size, alive, outstanding_work, shards."""
        with self._lock:
            load = list(self._outstanding)
        return [replica_status(r, load[r.index], timeout_s) for r in self.replicas]

    def _check_open(self) -> None:
        if self._closed:
            raise EngineNotReadyError("this RolloutController is shut down; create a new one")

    def shutdown(self) -> None:
        """Destroy every replica (shards killed, placement groups removed). Idempotent. If this
        controller started Ray itself it stops it too (so start Ray first, e.g. with
        actors.cluster.connect(), when several controllers share one session)."""
        if self._closed:
            return
        self._closed = True
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


def _reindexed(outs: list[GenerateOutput], indices: list[int]) -> list[GenerateOutput]:
    for o in outs:
        o.prompt_index = indices[o.prompt_index]
    return outs
