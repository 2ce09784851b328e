"""Replica: one tensor-parallel group of RolloutShards in one placement group, created and
destroyed as a unit. Rank 0 is the leader: it owns the Scheduler and answers `generate`."""
from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.errors import ReplicaError
from actors.placement import bundle_resource, create_placement_group
from actors.shard import RolloutShardActor
from rollout.config import EngineConfig, ModelConfig
from rollout.errors import ConfigError

logger = logging.getLogger(__name__)


def check_tp_size(model_config: ModelConfig, tp_size: int) -> None:
    """tp_size must split the heads, the KV heads and the MLP evenly (whole heads per rank)."""
    counts = {"num_attention_heads": model_config.num_attention_heads,
              "num_key_value_heads": model_config.num_key_value_heads,
              "intermediate_size": model_config.intermediate_size}
    if model_config.moe is not None:
        counts["moe_intermediate_size"] = model_config.moe.intermediate_size
    bad = {k: v for k, v in counts.items() if v % tp_size}
    if bad:
        raise ConfigError(f"tp_size={tp_size} does not divide {bad} of {model_config.architecture}; "
                          f"choose a tp_size that divides {counts}")


class Replica:
    """Create with `Replica(...)` (placement group placed, shards starting), then `wait_ready()`;
    or `Replica.start(...)` for both. Any failure destroys what was made."""

    def __init__(self, index: int, config: EngineConfig, node_id: str, *,
                 placement_timeout_s: float = 60.0, dist_timeout_s: float = 120.0):
        self.index, self.config, self.node_id = index, config, node_id
        self.tp_size = config.tp_size
        self.shards: list[Any] = []
        self.ready = False
        self._setup_refs: list[ray.ObjectRef] = []
        self.pg = create_placement_group(self.tp_size, bundle_resource(config), node_id,
                                         placement_timeout_s, name="")
        try:
            self.shards = [self._make_shard(rank) for rank in range(self.tp_size)]
            init_method = self.leader.pick_init_method.remote()  # a ref: Ray hands every shard its value
            self._setup_refs = [s.setup.remote(init_method, dist_timeout_s) for s in self.shards]
        except BaseException:
            self.destroy()
            raise

    @classmethod
    def start(cls, index: int, config: EngineConfig, node_id: str, *,
              start_timeout_s: float = 600.0, **kw: Any) -> "Replica":
        replica = cls(index, config, node_id, **kw)
        replica.wait_ready(start_timeout_s)
        return replica

    def _make_shard(self, rank: int):
        gpu = self.config.is_cuda
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
        return RolloutShardActor.options(
            num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy,
        ).remote(self.config, rank, self.tp_size)

    @property
    def leader(self):
        return self.shards[0]

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every shard has joined the TP group and loaded its weights; on the first
        failure (or the timeout) destroy the replica and raise."""
        deadline, pending = time.monotonic() + timeout_s, list(self._setup_refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1,
                                          timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise ReplicaError(f"replica {self.index}: {len(pending)} of {self.tp_size} "
                                       f"shard(s) not ready after {timeout_s:g}s")
                ray.get(ready[0])  # re-raises the shard's error (e.g. DistributedInitError)
            self.ready = True
        except BaseException:
            self.destroy()
            raise

    # ---- work -------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params, **kw: Any) -> ray.ObjectRef:
        """One Ray call for the whole sub-batch; the leader drives every step itself."""
        return self.leader.generate.remote(prompts, sampling_params, **kw)

    def node_ids(self) -> list[str]:
        return ray.get([s.node_id.remote() for s in self.shards])

    def status(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        return ray.get([s.status.remote() for s in self.shards], timeout=timeout_s)

    # ---- teardown ---------------------------------------------------------------------------
    def destroy(self, timeout_s: float = 10.0, graceful: bool = True) -> None:
        """Stop the leader (which releases the followers), kill every shard, remove the
        placement group. Safe to call twice and on a half-made replica. `graceful=False` (a
        failed replica) skips the leader's stop and just kills."""
        if self.shards:
            if self.ready and graceful:
                self._stop_leader(timeout_s)
            self.ready = False
            for shard in self.shards:
                ray.kill(shard, no_restart=True)
            self.shards = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _stop_leader(self, timeout_s: float) -> None:
        try:
            ray.get(self.leader.shutdown.remote(), timeout=timeout_s)
        except Exception as e:  # a dead or never-ready leader: killing it is enough
            logger.debug("replica %d: leader shutdown skipped (%s)", self.index, e)

    def __repr__(self) -> str:
        return f"Replica({self.index}, tp_size={self.tp_size}, node={self.node_id[:8]})"


__all__ = ["Replica", "check_tp_size"]
