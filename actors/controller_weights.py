"""The RolloutController's weight-sync API: the same methods as the Engine's, driven over every
shard of every replica. Each update: pause every leader at a step boundary (in-flight requests
by `pause_mode`), have every shard load its own slices (one Ray call per shard per update, never
per parameter), commit the new version on the leaders, resume. What can be checked without the update's bytes
(names, shapes, dtypes, the checkpoint, a pushed layout, the group) is checked on every shard
before any replica pauses. An update that some replicas fail leaves the controller on its
current version, so the replicas that took the new one, or were left holding a mix, go `stale`
(no work, generation refused) until a complete update lands: every replica that serves holds
the version the controller reports.

A push of a registered IPC layout (`IpcLayoutRef`) into single-rank replicas skips Ray: each
leader's loopback push channel (`weight_sync/push_channel.py`, opened once through Ray and
cached) carries the request, all replicas at once; a channel that fails sends that replica the
same request through Ray (which handles a dead shard), so no push is lost."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import ray
import torch
from ray.exceptions import RayActorError

from rollout.errors import ConfigError, EngineNotReadyError
from weight_sync.bucket import Bucket, UpdateManifest, pack_buckets
from weight_sync.errors import WeightUpdateError
from weight_sync.ipc import IpcHandle
from weight_sync.ipc_layout import IpcLayout, IpcLayoutRef, IpcLayoutUnknownError
from weight_sync.process_group import GroupAddress
from weight_sync.push_channel import (PushChannelClient, PushChannelError, PushChannelInfo, precheck_request,
                                      push_request, send_all)
from weight_sync.spec import TensorSpec
from weight_sync.update_args import check_pause_mode, next_version

logger = logging.getLogger(__name__)


class ControllerWeightsMixin:
    """Mixed into RolloutController; uses its replicas, `_weight_version`, `_weights_lock`, its
    prefix `_router` and the recovery helpers (`_serving_replicas`, `_call_leaders`,
    `_replica_failed`)."""

    _last_phases: dict = {}
    use_push_channels: bool = True  # registered IPC pushes into TP=1 replicas skip Ray
    last_ipc_path: str = ""  # the last ipc update: "channel", "ray", or "channel+ray" (fallbacks)

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

    def update_weights_from_ipc(self, handles: Union[IpcLayout, IpcLayoutRef, Sequence[IpcHandle]], *,
                                version: Optional[int] = None, allow_partial: bool = False,
                                pause_mode: Optional[str] = None) -> int:
        """A registered layout, a push of one (its id: a few bytes per shard), or bucket handles.
        A shard that lacks the layout raises `IpcLayoutUnknownError` (the sender registers again)."""
        payload = handles if isinstance(handles, (IpcLayout, IpcLayoutRef)) else list(handles)
        if isinstance(payload, IpcLayoutRef) and self.use_push_channels:
            out = self._push_over_channels(payload, version, allow_partial, pause_mode)
            if out is not None:
                return out
        self.last_ipc_path = "ray"
        return self._update("ipc", payload, version, allow_partial, pause_mode)

    # ---- the push channels (registered IPC into single-rank replicas, no Ray call per push) ----
    def ipc_push_channels(self) -> dict[int, PushChannelInfo]:
        """Replica index → its leader's push channel, for every serving single-rank replica
        whose channel opens (each opened once per shard, then cached). Empty for TP replicas."""
        with self._weights_lock:
            targets = self._serving_replicas()
            if any(r.tp_size != 1 for r in targets):
                return {}
            clients = self._channel_clients(targets)
            return {i: c.info for i, c in clients.items()}

    def ping_push_channel(self, index: int = 0) -> Optional[float]:
        """Seconds of one no-op round trip over replica `index`'s channel (None: no channel)."""
        with self._weights_lock:
            replica = next((r for r in self._serving_replicas() if r.index == index), None)
            if replica is None or replica.tp_size != 1:
                return None
            client = self._channel_clients([replica]).get(index)
            if client is None:
                return None
            t0 = time.perf_counter()
            try:
                client.call({"op": "ping"})
            except PushChannelError:
                self._drop_channel(index)
                return None
            return time.perf_counter() - t0

    def _channel_clients(self, targets: list) -> dict[int, PushChannelClient]:
        """Under the weights lock: a connected client per replica that has (or now opens) a
        channel. A rebuilt replica (a new Replica object) gets a new one."""
        cache = self.__dict__.setdefault("_push_clients", {})
        out = {}
        for replica in targets:
            cached = cache.get(replica.index)
            if cached is not None and cached[0] is replica:
                out[replica.index] = cached[1]
                continue
            self._drop_channel(replica.index)
            try:
                info = ray.get(replica.leader.open_push_channel.remote())
                client = PushChannelClient(info)
            except Exception as e:  # noqa: BLE001 — this replica keeps the Ray path
                logger.warning("replica %d: no push channel (%s: %s); using Ray", replica.index,
                               type(e).__name__, e)
                continue
            cache[replica.index] = (replica, client)
            out[replica.index] = client
        return out

    def _drop_channel(self, index: int) -> None:
        cached = self.__dict__.get("_push_clients", {}).pop(index, None)
        if cached is not None:
            cached[1].close()

    def _close_push_channels(self) -> None:
        for index in list(self.__dict__.get("_push_clients", {})):
            self._drop_channel(index)

    def _push_over_channels(self, ref: IpcLayoutRef, version: Optional[int], allow_partial: bool,
                            pause_mode: Optional[str]) -> Optional[int]:
        """`_update("ipc", ref)` for single-rank replicas, each shard reached over its channel:
        send to all, then read all replies. A replica whose channel fails gets the push through
        Ray (`_update_single_rank`: a dead shard goes to recovery); typed errors from a shard
        (`WeightUpdateError`, `IpcLayoutUnknownError`) are raised after every replica answered,
        as on the Ray path. None: not applicable (TP replicas, or no channel at all)."""
        check_pause_mode(pause_mode, ConfigError)
        with self._weights_lock:
            targets = self._serving_replicas()
            if not targets or any(r.tp_size != 1 for r in targets):
                return None
            clients = self._channel_clients(targets)
            if not clients:
                return None
            new_version = next_version(self._weight_version, version)
            fast = [r for r in targets if r.index in clients]
            slow = [r for r in targets if r.index not in clients]
            fast, slow = self._precheck_over_channels(ref, allow_partial, clients, fast, slow)
            replies = send_all([clients[r.index] for r in fast],
                               push_request(ref.layout_id, new_version, allow_partial, pause_mode))
            failed, done = [], []
            for replica, reply in zip(fast, replies):
                if isinstance(reply, PushChannelError):
                    logger.warning("replica %d: push channel failed (%s); pushing through Ray",
                                   replica.index, reply)
                    self._drop_channel(replica.index)
                    slow.append(replica)
                elif reply.get("ok"):
                    done.append(replica)
                else:
                    failed.append((replica, _typed_error(reply)))
            if slow:
                more_done, more_failed = self._update_single_rank("ipc", ref, new_version, allow_partial,
                                                                  pause_mode, slow)
                done, failed = done + more_done, failed + more_failed
            self.last_ipc_path = "channel+ray" if slow else "channel"
            self._finish_update(new_version, done, failed)
        return new_version

    def _precheck_over_channels(self, ref: IpcLayoutRef, allow_partial: bool, clients: dict,
                                fast: list, slow: list) -> tuple[list, list]:
        """Every replica holds the layout, or the push fails before any replica loads it (a
        rebuilt one that lost it would otherwise leave the others stale): over the channels,
        and through Ray for the replicas without one (a channel that fails now joins them)."""
        replies = send_all([clients[r.index] for r in fast], precheck_request(ref.layout_id, allow_partial))
        still_fast, errors = [], []
        for replica, reply in zip(fast, replies):
            if isinstance(reply, PushChannelError):
                self._drop_channel(replica.index)
                slow.append(replica)
            elif reply.get("ok"):
                still_fast.append(replica)
            else:
                errors.append(_typed_error(reply))
        if errors:  # (after every reply is read: a failed channel is dropped, not left cached)
            raise errors[0]
        if slow:
            slow = self._precheck_everywhere("ipc", ref, allow_partial, slow)
        return still_fast, slow

    def drop_ipc_layouts(self, layout_ids: Optional[Sequence[str]] = None) -> None:
        """Every shard closes these registered IPC layouts (all when None)."""
        with self._weights_lock:
            ray.get([s.drop_ipc_layouts.remote(layout_ids) for s in self._shards()])

    def weight_sync_free_bytes(self) -> Optional[int]:
        """The smallest free device memory over the shards (None on CPU): sizes a sender's buckets."""
        free = [f for f in ray.get([s.free_device_bytes.remote() for s in self._shards()]) if f is not None]
        return min(free) if free else None

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
        check_pause_mode(pause_mode, ConfigError)
        with self._weights_lock:
            new_version = next_version(self._weight_version, version)
            targets = self._serving_replicas()
            if not targets:
                raise EngineNotReadyError("no replica can take a weight update now: "
                                          f"{self._state} (see status())")
            targets = self._precheck_everywhere(kind, payload, allow_partial, targets)
            if all(r.tp_size == 1 for r in targets):
                done, failed = self._update_single_rank(kind, payload, new_version, allow_partial,
                                                        pause_mode, targets)
            else:
                done, failed = self._update_tp(kind, payload, new_version, allow_partial, pause_mode,
                                               targets)
            self._finish_update(new_version, done, failed)
        return new_version

    def _precheck_everywhere(self, kind: str, payload, allow_partial: bool, targets: list) -> list:
        """Every shard checks what it can without the bytes (`WeightUpdater.precheck`) before
        any replica pauses: a bad update, or one that some replica could not take (a checkpoint
        its node does not have, a layout it does not hold), fails with nothing changed. A replica
        whose shard died goes to recovery and is left out."""
        ok, failed = self._gather(
            targets, lambda r: [s.precheck_weights.remote(kind, payload, allow_partial) for s in r.shards],
            "a weight update's precheck")
        if failed:
            raise _unwrap(failed[0][1])
        return ok

    def _finish_update(self, version: int, done: list, failed: list) -> None:
        """Under the weights lock, after an update: all replicas took it — the controller
        serves `version` and stale replicas now complete are alive again; some failed — the
        controller keeps its version, the replicas that do not hold it stop serving, and the
        first replica's error is raised."""
        if self._router is not None:
            with self._lock:
                self._router.clear()  # every replica that loaded emptied its prefix cache
        if not failed:
            self._weight_version, self._weights_updated = version, True
            self._refresh_stale(done)
            return
        reason = self._failure_reason(version, failed)
        for replica in done:  # they hold weights the controller does not serve
            if not self._holds_a_mix(replica):  # (TP replicas were fenced before they resumed)
                self._fence(replica, version, reason)
        mixed = [r for r, _ in failed if self._holds_a_mix(r)]
        self._mark_stale(done + mixed, reason)
        raise failed[0][1]

    def _failure_reason(self, version: int, failed: list) -> str:
        error = failed[0][1]
        return (f"weight update to version {version} failed on replica(s) "
                f"{[r.index for r, _ in failed]} ({type(error).__name__}: {error}); the controller "
                f"serves version {self._weight_version}")

    def _fence(self, replica, version: int, reason: str) -> None:
        """The replica, which took `version` while others failed, refuses to generate (its
        in-flight requests end now, with the tokens they have) until a complete update lands."""
        reason = f"this replica took version {version}, which others failed: {reason}"
        try:
            ray.get(replica.leader.abort_if_incomplete.remote(reason))
        except RayActorError as e:
            self._replica_failed(replica.index, f"{type(e).__name__} after a weight update")
        except Exception as e:  # noqa: BLE001 — it is marked stale below all the same
            logger.error("replica %d: could not mark its weights incomplete: %s", replica.index, e)

    def _holds_a_mix(self, replica) -> bool:
        try:
            return ray.get(replica.leader.incomplete_reason.remote()) is not None
        except RayActorError as e:
            self._replica_failed(replica.index, f"{type(e).__name__} after a weight update")
            return False

    def _update_tp(self, kind: str, payload, version: int, allow_partial: bool,
                   pause_mode: Optional[str], targets: list) -> tuple[list, list]:
        """TP replicas: pause every leader, every shard loads, commit (only if every replica
        loaded: one commit for all), resume. Returns the replicas that took the update and the
        (replica, error) pairs of those that did not."""
        t0 = time.perf_counter()
        targets = self._pause_all(targets, pause_mode)
        t1 = time.perf_counter()
        try:
            failed, targets = self._apply_everywhere(kind, payload, allow_partial, targets)
            failed_ids = {r.index for r, _ in failed}
            done = [r for r in targets if r.index not in failed_ids]
            if not failed:
                return self._call_leaders(done, "commit_weights", version), failed
            for replica in done:  # loaded, not committed: fenced before it resumes
                self._fence(replica, version, self._failure_reason(version, failed))
            return done, failed
        finally:
            t2 = time.perf_counter()
            self._call_leaders(targets, "resume")
            self._last_phases = {"pause": t1 - t0, "load": t2 - t1, "resume": time.perf_counter() - t2}

    def _pause_all(self, targets: list, pause_mode: Optional[str]) -> list:
        """Every leader paused (a dead one goes to recovery), or, if one fails to pause, the
        others resumed and its error raised: no leader is left paused."""
        paused, failed = self._gather(targets, lambda r: r.leader.pause.remote(pause_mode), "pause")
        if failed:
            self._call_leaders(paused, "resume")
            raise failed[0][1]
        return paused

    def _update_single_rank(self, kind: str, payload, version: int, allow_partial: bool,
                            pause_mode: Optional[str], targets: list) -> tuple[list, list]:
        """Replicas of one rank: one call each does pause → load → commit → resume. Returns the
        replicas that took the update and the (replica, error) pairs of those that did not; a
        replica whose actor died goes to recovery (in neither list)."""
        done, failed = self._gather(
            targets, lambda r: r.leader.update_weights.remote(kind, payload, allow_partial, pause_mode,
                                                              version), "update_weights")
        return done, [(r, _unwrap(e)) for r, e in failed]

    def _apply_everywhere(self, kind: str, payload, allow_partial: bool, replicas: list
                          ) -> tuple[list[tuple[Any, BaseException]], list]:
        """Every shard loads; a replica with any shard left incomplete is told to refuse; one
        whose shard died goes to recovery. Returns the (replica, first error) pairs of the
        replicas where a rank failed, and the replicas still in."""
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
                except Exception as e:  # noqa: BLE001 — collected, settled by _finish_update
                    if not failed:
                        errors.append((replica, _unwrap(e)))
                    failed.append(rank)
            if died is not None:
                self._replica_failed(replica.index, f"{type(died).__name__} during a weight update")
                continue
            still_in.append(replica)
            if failed:
                incomplete = ray.get([s.incomplete_reason.remote() for s in replica.shards])
                reason = next((r for r in incomplete if r), None)
                if reason is None and len(failed) < replica.tp_size:  # others loaded: a mix
                    reason = "the other ranks loaded the update"
                ray.get(replica.leader.abort_if_incomplete.remote(
                    f"rank(s) {failed} of replica {replica.index}: {reason}" if reason else None))
        return errors, still_in


def _typed_error(reply: dict) -> WeightUpdateError:
    """A shard's error from its push channel, typed as the Ray path would raise it."""
    message = str(reply.get("message", ""))
    if reply.get("error_type") == "IpcLayoutUnknownError":
        return IpcLayoutUnknownError(message)
    if reply.get("error_type") == "WeightUpdateError":
        return WeightUpdateError(message)
    return WeightUpdateError(f"{reply.get('error_type')}: {message}")


def _unwrap(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    if isinstance(cause, WeightUpdateError):
        return cause
    return e if isinstance(e, WeightUpdateError) else WeightUpdateError(str(e))
