"""RolloutShard: the Ray actor that holds one tensor-parallel rank of one replica.

Rank 0 (the leader) runs a TPLeaderEngine (Scheduler + its ModelRunner shard) and answers
`generate`; ranks > 0 run a TPFollower loop in a background thread, so the actor stays free for
control calls (status, shutdown, weight updates). Per step nothing goes through Ray: the leader
broadcasts the batch metadata over the TP group's gloo CPU group (rollout/tp_worker.py)."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import ray
import torch

from rollout.config import EngineConfig
from rollout.distributed import (LOOPBACK, default_backend, destroy_tp_group, free_port,
                                 init_tp_group, tcp_init_method)
from rollout.engine import WEIGHTS_RELEASED
from rollout.model_runner import ModelRunner
from rollout.tp_worker import TPFollower, TPLeaderEngine
from weight_sync.bucket import Bucket
from weight_sync.ipc_layout import IpcLayoutRef
from weight_sync.push_channel import PushChannelInfo, PushChannelServer
from weight_sync.updater import WeightUpdater, apply_update

logger = logging.getLogger(__name__)


class RolloutShard:
    """One TP rank. Created by a Replica inside its placement group; wrapped with `ray.remote`
    below (`RolloutShardActor`) so the class itself stays importable and testable."""

    def __init__(self, config: EngineConfig, rank: int, tp_size: int):
        if not config.is_cuda:
            torch.set_num_threads(1)  # one CPU per shard (its bundle)
        # Ray gives this process exactly one GPU, visible as cuda:0.
        self.config = dataclasses.replace(config, device="cuda") if config.is_cuda else config
        self.rank, self.tp_size = rank, tp_size
        self.engine: Optional[TPLeaderEngine] = None
        self.follower: Optional[TPFollower] = None
        self._thread: Optional[threading.Thread] = None
        self._follower_error: Optional[str] = None
        self.updater: Optional[WeightUpdater] = None
        self._push_channel: Optional[PushChannelServer] = None

    # ---- set-up ---------------------------------------------------------------------------
    def pick_init_method(self) -> str:
        """Leader only: a rendezvous address on a free port of this node (the TP group never
        leaves this node, so the loopback address serves every rank)."""
        return tcp_init_method(free_port(LOOPBACK), LOOPBACK)

    def setup(self, init_method: str, timeout_s: float) -> int:
        """Join the TP group and build this rank's shard. Returns the rank when ready."""
        tp = init_tp_group(self.rank, self.tp_size, init_method,
                           default_backend(self.config.device), timedelta(seconds=timeout_s))
        if tp.is_leader:
            self.engine = TPLeaderEngine(self.config, tp)
            self.updater = self.engine.updater
        else:
            self.follower = TPFollower(self.config, tp)
            self.updater = WeightUpdater(self.follower.runner, self.config.check_finite)
            self._thread = threading.Thread(target=self._serve, name=f"tp-follower-{self.rank}",
                                            daemon=True)
            self._thread.start()
        return self.rank

    def _serve(self) -> None:
        try:
            self.follower.run()
        except Exception as e:  # the leader died or a collective failed
            self._follower_error = f"{type(e).__name__}: {e}"
            logger.exception("TP follower rank %d stopped; its process exits", self.rank)
            # A follower whose loop stopped can never serve its replica again, and a leader's
            # broadcast to a live peer that no longer receives waits without bound (the step
            # channel's group allows days: followers idle between calls). Exiting closes the
            # sockets: the leader's next collective fails at once, and the controller, which
            # finds this shard dead, rebuilds the replica.
            os._exit(1)

    # ---- work (leader) ----------------------------------------------------------------------
    @ray.method(concurrency_group="generate")
    def generate(self, prompts, sampling_params=None, **kw: Any):
        return self._leader().generate(prompts, sampling_params, **kw)

    @ray.method(concurrency_group="generate")
    def prefill_logits(self, prompts):
        return self._leader().prefill_logits(prompts)

    @ray.method(concurrency_group="generate")
    def score(self, sequences, start=1, temperature=1.0):
        return self._leader().score(sequences, start, temperature)

    def _leader(self) -> TPLeaderEngine:
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank} is not a TP leader (or is not set up)")
        return self.engine

    # ---- weight sync (every rank loads its own slices; the controller sequences the steps) ---
    def pause(self, pause_mode: Optional[str] = None) -> None:
        self._leader().pause_generation(pause_mode)

    def resume(self) -> None:
        self._leader().resume_generation()

    def commit_weights(self, version: int) -> None:
        self._leader().commit_weight_version(version)

    def abort_all(self) -> int:
        """Leader: Engine.abort_all (the default concurrency group: it runs beside a generate)."""
        return self._leader().abort_all()

    def abort_if_incomplete(self, reason: Optional[str] = None) -> None:
        """Leader, after a failed update: `reason` says another rank of this replica failed."""
        if reason is not None:
            self.updater.mark_incomplete(reason)
        self._leader().abort_if_incomplete()

    def check_weights(self, specs, allow_partial: bool = False) -> None:
        self.updater.validate(list(specs), allow_partial)

    def precheck_weights(self, kind: str, payload, allow_partial: bool = False) -> None:
        """Raises now if this rank could not take the update (names, shapes, dtypes, a missing
        checkpoint, an IPC layout it does not hold, no weight-sync group); changes nothing."""
        self.updater.precheck(kind, payload, allow_partial)

    def apply_weights(self, kind: str, payload, allow_partial: bool = False) -> int:
        """Load an update into this rank's shard (the leader is paused by the controller)."""
        return apply_update(self.updater, kind, _fetched(kind, payload), allow_partial)

    def update_weights(self, kind: str, payload, allow_partial: bool, pause_mode: Optional[str],
                       version: int) -> int:
        """A replica of one rank: pause → load → commit → resume in one call."""
        t0 = time.perf_counter()
        payload = _fetched(kind, payload)
        try:
            return self._leader().update_weights(
                lambda: apply_update(self.updater, kind, payload, allow_partial), version, pause_mode,
                lambda: self.updater.precheck(kind, payload, allow_partial))  # before the pause
        finally:
            self._last_call_s = time.perf_counter() - t0

    def open_push_channel(self) -> PushChannelInfo:
        """Leader of a single-rank replica: the loopback channel that carries registered IPC
        pushes without a Ray call (`weight_sync/push_channel.py`); opened once, then the same
        address and token. Each push over it runs `update_weights("ipc", IpcLayoutRef(...))`."""
        self._leader()
        if self.tp_size != 1:
            raise RuntimeError("the push channel serves single-rank replicas only")
        if self._push_channel is None:
            self._push_channel = PushChannelServer(self._channel_push, self._channel_precheck)
        return self._push_channel.info

    def _channel_push(self, layout_id: str, version: int, allow_partial: bool,
                      pause_mode: Optional[str]) -> dict:
        out = self.update_weights("ipc", IpcLayoutRef(layout_id), allow_partial, pause_mode, version)
        return {"version": int(out), "incomplete": self.updater.incomplete_reason is not None}

    def _channel_precheck(self, layout_id: str, allow_partial: bool) -> None:
        self.updater.precheck("ipc", IpcLayoutRef(layout_id), allow_partial)

    def drop_ipc_layouts(self, layout_ids=None) -> None:
        """Close registered IPC layouts (the trainer's memory is unmapped)."""
        if self.engine is not None:
            self.engine.drop_ipc_layouts(layout_ids)
        else:
            self.updater.ipc_layouts.drop(layout_ids)

    def free_device_bytes(self) -> Optional[int]:
        """Free memory of this shard's device (None on CPU): sizes a sender's buckets."""
        device = self._runner().device
        return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

    def update_phases(self) -> dict:
        """The leader's phases of the last update, and the seconds its whole call took here
        (what the caller sees beyond that is the Ray round trip)."""
        return {**self._leader().last_update_phases, "shard_call": getattr(self, "_last_call_s", 0.0)}

    def touch(self, refs) -> int:
        """Benchmarks: fetch objects from the store (the tensor transport's floor)."""
        return sum(ray.get(r).numel() for r in refs)

    def receive_raw(self, numel: int, dtype) -> float:
        """Benchmarks: one plain broadcast into this rank (the nccl transport's floor)."""
        return self.updater.receive_raw(numel, dtype)

    def incomplete_reason(self) -> Optional[str]:
        return self.updater.incomplete_reason

    def join_weight_group(self, addr, rank: int) -> None:
        self.updater.join_group(addr, rank)

    def leave_weight_group(self) -> None:
        self.updater.leave_group()

    # ---- a rebuilt replica catches up: each shard copies the same rank of a healthy replica ----
    def export_local_weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (CPU copies; Ray stores the dict in the object store)."""
        return self._runner().export_weights()

    def import_local_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """Copy the same rank's `export_local_weights()` of another replica in place."""
        return self._runner().import_weights(weights)

    # ---- memory release / resume (colocated training) ---------------------------------------
    def release_memory(self, tags) -> None:
        """Leader: waits for its generation, then refuses work until resumed (and, for weights,
        until a full update). The controller releases leaders before followers."""
        if self.engine is not None:
            self.engine.release_memory(tags)
            return
        self.follower.runner.release_memory(tags)
        if "weights" in self.follower.runner.released:
            self.updater.mark_incomplete(WEIGHTS_RELEASED, log=False)

    def resume_memory(self, tags) -> None:
        if self.engine is not None:
            self.engine.resume_memory(tags)
        else:
            self.follower.runner.resume_memory(tags)

    def _runner(self) -> ModelRunner:
        if self.engine is not None:
            return self.engine.runner
        if self.follower is not None:
            return self.follower.runner
        raise RuntimeError(f"rank {self.rank} is not set up")

    # ---- control ----------------------------------------------------------------------------
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "node_id": self.node_id()}
        if self.engine is not None or self.follower is not None:
            out["released"] = sorted(self._runner().released)  # memory tags freed (release_memory)
        if self.engine is not None:
            out.update(weight_version=self.engine.weight_version,
                       stats=dataclasses.asdict(self.engine.stats))
        if self.follower is not None:
            out.update(steps=self.follower.steps, serving=self._thread.is_alive(),
                       error=self._follower_error)
        return out

    def shutdown(self) -> None:
        """Leader: stop the followers' loops, then free the shard. Followers: wait for the loop
        to end (the leader's StopMessage), then leave the group."""
        if self._push_channel is not None:
            self._push_channel.close()
            self._push_channel = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            if self._thread.is_alive():  # still inside a collective: leave it to ray.kill
                return
        self.follower = None
        destroy_tp_group()


def _fetched(kind: str, payload):
    """Tensor updates come as (meta, ObjectRef) pairs: the bytes are fetched here from the
    object store (zero-copy on a CPU node)."""
    if kind == "tensor":
        return [Bucket(meta, ray.get(ref)) for meta, ref in payload]
    return payload


# A threaded actor: status()/shutdown() and weight updates run while generate() is busy. The
# generate calls (which share the engine's batch: an agent loop's trajectories, one call a turn
# each) and prefill_logits have threads of their own, so however many arrive they never take the
# threads that a weight update's pause → load → commit → resume, or status and shutdown, need
# (they would wait for a resume no thread is left to run); up to 256 calls batch at once.
RolloutShardActor = ray.remote(max_concurrency=4, concurrency_groups={"generate": 256})(RolloutShard)
