"""The RolloutController's weight-sync API: the same methods as the Engine's, driven over every
shard of every replica. Each update: pause every leader at a step boundary (in-flight requests
by `pause_mode`), have every shard load its own slices (one Ray call per shard per update, never
per parameter), commit the new version on the leaders, resume. A shard that fails after its first
write leaves its replica refusing to generate until a complete update lands."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import ray
import torch
from ray.exceptions import RayActorError

from rollout.config import PAUSE_MODES
from rollout.errors import ConfigError, EngineNotReadyError
from weight_sync.bucket import Bucket, UpdateManifest, pack_buckets
from weight_sync.errors import WeightUpdateError
from weight_sync.ipc import IpcHandle
from weight_sync.process_group import GroupAddress
from weight_sync.spec import TensorSpec


class ControllerWeightsMixin:
    """Mixed into RolloutController; uses its replicas, `_weight_version`, `_weights_lock` and
    the recovery helpers (`_serving_replicas`, `_call_leaders`, `_replica_failed`)."""

    _last_phases: dict = {}

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def num_weight_sync_ranks(self) -> int:
        return sum(r.tp_size for r in self._serving_replicas())

    def _shards(self) -> list[Any]:
        return [s for r in self._serving_replicas() for s in r.shards]

    def check_weights_update(self, specs: Sequence[TensorSpec], allow_partial: bool = False) -> None:
        replica = next(iter(self._serving_replicas()), None)
        if replica is None:
            raise self._no_replica_error()
        ray.get(replica.leader.check_weights.remote(list(specs), allow_partial))

    def update_weights_from_tensor(self, weights, *, version: Optional[int] = None,
                                   allow_partial: bool = False, pause_mode: Optional[str] = None) -> int:
        """`weights`: (HF name, full tensor) pairs or Buckets; one `ray.put` per bucket, every
        shard fetches the same objects."""
        weights = list(weights)
        if weights and not isinstance(weights[0], Bucket):
            weights = pack_buckets(weights, device=torch.device("cpu"))
        payload = [(b.meta, ray.put(b.flat.cpu())) for b in weights]
        return self._update("tensor", payload, version, allow_partial, pause_mode)

    def update_weights_from_disk(self, path: Union[str, Path], *, version: Optional[int] = None,
                                 allow_partial: bool = False, pause_mode: Optional[str] = None) -> int:
        return self._update("disk", str(path), version, allow_partial, pause_mode)

    def update_weights_from_ipc(self, handles: Sequence[IpcHandle], *, version: Optional[int] = None,
                                allow_partial: bool = False, pause_mode: Optional[str] = None) -> int:
        return self._update("ipc", list(handles), version, allow_partial, pause_mode)

    def init_weights_update_group(self, addr: GroupAddress, rank_offset: int = 1) -> None:
        """Every shard joins the trainer's group (ranks rank_offset, rank_offset + 1, ...)."""
        ray.get([s.join_weight_group.remote(addr, rank_offset + i) for i, s in enumerate(self._shards())])

    def destroy_weights_update_group(self) -> None:
        ray.get([s.leave_weight_group.remote() for s in self._shards()])

    def update_weights_from_distributed(self, manifest: UpdateManifest, *, version: Optional[int] = None,
                                        allow_partial: bool = False,
                                        pause_mode: Optional[str] = None) -> int:
        return self._update("distributed", manifest, version, allow_partial, pause_mode)

    # ---- benchmarks ---------------------------------------------------------------------------
    def last_update_phases(self) -> dict:
        """Seconds of the last update's phases on replica 0 (pause, load, resume), single-rank
        replicas only; TP replicas report the driver-side phases."""
        if self.replicas[0].tp_size == 1:
            return ray.get(self.replicas[0].leader.update_phases.remote())
        return dict(self._last_phases)

    def raw_broadcast_floor(self, sender, flat: torch.Tensor) -> float:
        """Seconds for one plain broadcast of `flat` from the sender to every shard."""
        t0 = time.perf_counter()
        refs = [s.receive_raw.remote(flat.numel(), flat.dtype) for s in self._shards()]
        sender.group.broadcast(flat, src=0)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        ray.get(refs)
        return time.perf_counter() - t0

    # ---- pause → load everywhere → commit → resume ---------------------------------------------
    def _update(self, kind: str, payload, version: Optional[int], allow_partial: bool,
                pause_mode: Optional[str]) -> int:
        """Over the replicas that take updates (alive, and stale ones waiting for one), under the
        weights lock (a rebuilt replica catches up before or after, never during). A replica
        whose shard dies on the way goes to recovery; the update goes on for the others."""
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        with self._weights_lock:
            new_version = self._weight_version + 1 if version is None else int(version)
            targets = self._serving_replicas()
            if not targets:
                raise EngineNotReadyError("no replica can take a weight update now: "
                                          f"{self._state} (see status())")
            if all(r.tp_size == 1 for r in targets):
                targets = self._update_single_rank(kind, payload, new_version, allow_partial,
                                                   pause_mode, targets)
            else:
                targets = self._update_tp(kind, payload, new_version, allow_partial, pause_mode,
                                          targets)
            self._weight_version, self._weights_updated = new_version, True
            self._refresh_stale(targets)
        return new_version

    def _update_tp(self, kind: str, payload, version: int, allow_partial: bool,
                   pause_mode: Optional[str], targets: list) -> list:
        """TP replicas: pause every leader, every shard loads, commit, resume. Returns the
        replicas that took the update."""
        t0 = time.perf_counter()
        targets = self._call_leaders(targets, "pause", pause_mode)
        t1 = time.perf_counter()
        try:
            errors, targets = self._apply_everywhere(kind, payload, allow_partial, targets)
            if errors:
                raise errors[0]
            return self._call_leaders(targets, "commit_weights", version)
        finally:
            t2 = time.perf_counter()
            self._call_leaders(targets, "resume")
            self._last_phases = {"pause": t1 - t0, "load": t2 - t1, "resume": time.perf_counter() - t2}

    def _update_single_rank(self, kind: str, payload, version: int, allow_partial: bool,
                            pause_mode: Optional[str], targets: list) -> list:
        """Replicas of one rank: one call each does pause → load → commit → resume."""
        refs = [(r, r.leader.update_weights.remote(kind, payload, allow_partial, pause_mode, version))
                for r in targets]
        errors, done = [], []
        for replica, ref in refs:
            try:
                ray.get(ref)
                done.append(replica)
            except RayActorError as e:
                self._replica_failed(replica.index, f"{type(e).__name__} during a weight update")
            except Exception as e:  # noqa: BLE001 — collected, the first one is re-raised
                errors.append(_unwrap(e))
        if errors:
            raise errors[0]
        return done

    def _apply_everywhere(self, kind: str, payload, allow_partial: bool, replicas: list
                          ) -> tuple[list[BaseException], list]:
        """Every shard loads; a replica with any shard left incomplete is told to refuse; one
        whose shard died goes to recovery. Returns the errors and the replicas still in."""
        refs = {(r.index, rank): s.apply_weights.remote(kind, payload, allow_partial)
                for r in replicas for rank, s in enumerate(r.shards)}
        errors, still_in = [], []
        for replica in replicas:
            failed, died = [], None
            for rank in range(replica.tp_size):
                try:
                    ray.get(refs[(replica.index, rank)])
                except RayActorError as e:
                    died = e
                except Exception as e:  # noqa: BLE001 — collected, the first one is re-raised
                    errors.append(_unwrap(e))
                    failed.append(rank)
            if died is not None:
                self._replica_failed(replica.index, f"{type(died).__name__} during a weight update")
                continue
            still_in.append(replica)
            if failed:
                incomplete = ray.get([s.incomplete_reason.remote() for s in replica.shards])
                reason = next((r for r in incomplete if r), None)
                ray.get(replica.leader.abort_if_incomplete.remote(
                    f"rank(s) {failed} of replica {replica.index}: {reason}" if reason else None))
        return errors, still_in


def _unwrap(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    if isinstance(cause, WeightUpdateError):
        return cause
    return e if isinstance(e, WeightUpdateError) else WeightUpdateError(str(e))
