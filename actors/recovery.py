"""Replica failure recovery for the RolloutController.

When a replica's generate call fails because one of its shards died (the leader's call raises
`RayActorError`; a dead follower makes the leader's next collective fail, and a probe of the
shards confirms it), the controller:

1. marks the replica `rebuilding` (it takes no work and no weight updates) and re-runs the failed
   part's prompts — same SamplingParams, same already-drawn seeds, so the same samples — on the
   healthy replica with the least outstanding work; those outputs say `rerun_after_failure`;
2. in a background thread destroys the replica and creates a new one with the same index on the
   same node, then brings it to the latest weights before it takes work: under the weights lock
   (no update can interleave) each new shard copies the same rank of a healthy replica
   (`export_local_weights` → object store → `import_local_weights`, in place), and the leader
   commits the controller's weight version. Only then is it `alive` again.

With no healthy replica to copy from: if no weight update ever landed, the checkpoint is the
latest weights and the replica is `alive`; otherwise it is `stale` — it refuses to generate and
takes no work until the next full weight update lands (it never serves stale weights). A weight
update that some replicas failed leaves the others `stale` the same way (controller_weights). A
rebuild that fails leaves the replica `dead` (its new actors and placement group removed). `controller.status()` shows each replica's state,
restart count and last failure.

A weight-sync process group (`init_weights_update_group`) does not include a rebuilt replica's
new shards: after a rebuild the trainer re-creates the group (a new `WeightSender`)."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import ray
from ray.exceptions import RayActorError

from actors.errors import ReplicaError
from actors.health import replica_status
from actors.replica import Replica
from rollout.errors import EngineNotReadyError, RolloutError

if TYPE_CHECKING:
    from actors.controller import _Call, _Part

logger = logging.getLogger(__name__)

ALIVE, REBUILDING, STALE, DEAD = "alive", "rebuilding", "stale", "dead"
MAX_RERUNS = 3  # a part re-run this many times (its replicas kept dying) fails the call
PROBE_TIMEOUT_S = 10.0


class RecoveryMixin:
    """Mixed into RolloutController; uses its replicas, `_state`, `_cv` (over `_lock`),
    `_weights_lock`, `_outstanding` and the dispatch/settle methods."""

    # ---- a failed part ---------------------------------------------------------------------
    def _recover_part(self, call: "_Call", part: "_Part", err: BaseException) -> None:
        """Runs in its own thread (probing and re-dispatching are blocking Ray calls)."""
        try:
            down = self._replica_down(part.replica, err)
        except Exception as e:  # noqa: BLE001 — e.g. shut down meanwhile: the call must still end
            logger.warning("replica %d: could not probe it (%s); the part fails", part.replica, e)
            down = False
        if not down:
            self._settle(call, part, err, None)  # the request's own error: no replica failed
            return
        self._replica_failed(part.replica, _describe(err))
        unbooked = dataclasses.replace(part, cost=0)
        with self._lock:
            self._outstanding[part.replica] -= part.cost
        if part.attempt >= MAX_RERUNS:
            self._settle(call, unbooked, ReplicaError(f"prompts {part.indices[:4]}... failed on "
                                                      f"{part.attempt + 1} replicas in a row"), None)
            return
        try:
            target = self._pick_alive()
        except RolloutError as e:
            self._settle(call, unbooked, e, None)
            return
        logger.warning("replica %d failed; re-running its %d prompt(s) on replica %d",
                       part.replica, len(part.indices), target)
        rerun = dataclasses.replace(part, replica=target, attempt=part.attempt + 1)
        with self._lock:
            self._outstanding[target] += rerun.cost
        self._dispatch(call, rerun)

    def _replica_down(self, index: int, err: BaseException) -> bool:
        if isinstance(err, RayActorError):
            return True
        if isinstance(err, RolloutError):  # typed: the request or the weights, not a dead shard
            return False
        return not self._probe(index)

    def _probe(self, index: int) -> bool:
        """Every shard answers in time and no follower loop has stopped."""
        return replica_status(self.replicas[index], 0, PROBE_TIMEOUT_S)["alive"]

    def _pick_alive(self) -> int:
        """The alive replica with the least outstanding work; waits while replicas rebuild."""
        deadline = time.monotonic() + self._start_timeout_s
        with self._cv:
            while True:
                if self._closed:
                    raise EngineNotReadyError("this RolloutController is shut down")
                alive = [i for i, s in enumerate(self._state) if s == ALIVE]
                if alive:
                    return min(alive, key=self._outstanding.__getitem__)
                if REBUILDING not in self._state:
                    raise self._no_replica_error()
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise ReplicaError(f"no replica came back within {self._start_timeout_s:g}s")

    def _no_replica_error(self) -> RolloutError:
        if STALE in self._state:
            why = sorted({self._last_failure[i] or "" for i, s in enumerate(self._state) if s == STALE})
            return EngineNotReadyError(
                f"no live replica holds the complete weights of version {self._weight_version} "
                f"(stale: {'; '.join(w for w in why if w) or 'rebuilt from the checkpoint'}); push "
                f"a full weight update")
        return ReplicaError(f"no replica is alive: {self._last_failure}")

    # ---- rebuilding ------------------------------------------------------------------------
    def _replica_failed(self, index: int, reason: str) -> None:
        """Take the replica out of service and rebuild it in the background (once)."""
        with self._cv:
            if self._closed or self._state[index] not in (ALIVE, STALE):
                return
            self._state[index] = REBUILDING
            self._restarts[index] += 1
            if self._router is not None:
                self._router.forget_replica(index)  # its successor starts with an empty cache
            self._last_failure[index] = reason
            thread = threading.Thread(target=self._rebuild, args=(index,), daemon=True,
                                      name=f"rebuild-replica-{index}")
            self._recovery_threads.append(thread)
        logger.error("replica %d failed (%s); rebuilding it", index, reason)
        thread.start()

    def _rebuild(self, index: int) -> None:
        old = self.replicas[index]
        old.destroy(graceful=False)
        new: Optional[Replica] = None
        try:
            new = Replica(index, self.config, old.node_id, placement_timeout_s=self._placement_timeout_s,
                          dist_timeout_s=self._dist_timeout_s)
            new.wait_ready(self._start_timeout_s)
            # Caught up and put in service under one hold of the weights lock: an update either
            # lands before (and the copy has it) or after (and includes this replica)
            with self._weights_lock:
                state = self._catch_up(new)
                with self._cv:
                    if not self._closed:
                        self.replicas[index], self._state[index] = new, state
                        self._cv.notify_all()
                        new = None
            if new is not None:  # shut down meanwhile
                new.destroy()
            logger.info("replica %d rebuilt: %s", index, state)
        except Exception as e:  # noqa: BLE001 — recorded for status(); the replica stays out
            logger.error("rebuilding replica %d failed: %s", index, e)
            if new is not None:  # its actors and placement group would outlive it
                _destroy_quietly(new)
            with self._cv:
                self._state[index] = DEAD
                self._last_failure[index] = f"rebuild failed: {type(e).__name__}: {e}"
                self._cv.notify_all()

    def _catch_up(self, new: Replica) -> str:
        """Bring a fresh replica to the latest weights; returns its state (alive or stale)."""
        source = self._weights_source(exclude=new.index)
        if source is not None:
            exported = [s.export_local_weights.remote() for s in source.shards]
            ray.get([d.import_local_weights.remote(w) for d, w in zip(new.shards, exported)])
            state = ALIVE
        elif not self._weights_updated:
            state = ALIVE  # no update ever landed: the checkpoint is the latest weights
        else:
            ray.get(new.leader.abort_if_incomplete.remote(
                f"replica {new.index} was rebuilt from the checkpoint after a failure and no healthy "
                f"replica held version {self._weight_version} to copy"))
            state = STALE
        ray.get(new.leader.commit_weights.remote(self._weight_version))
        if self._released:
            self._release_on([new], tuple(self._released))
        return state

    def _weights_source(self, exclude: int) -> Optional[Replica]:
        """An alive replica whose weights are complete (so: the latest)."""
        for replica in self._serving_replicas(states=(ALIVE,)):
            if replica.index == exclude:
                continue
            try:
                if ray.get(replica.leader.incomplete_reason.remote(), timeout=PROBE_TIMEOUT_S) is None:
                    return replica
            except Exception:  # noqa: BLE001 — not a usable source
                continue
        return None

    # ---- helpers for the weight and memory paths --------------------------------------------
    def _serving_replicas(self, states: tuple[str, ...] = (ALIVE, STALE)) -> list[Replica]:
        """Replicas that take weight updates (alive, and stale ones waiting for an update)."""
        with self._lock:
            return [r for r, s in zip(self.replicas, self._state) if s in states]

    def _call_leaders(self, replicas: list[Replica], method: str, *args: Any) -> list[Replica]:
        """`method` on each leader; a replica whose actor died goes to recovery and is left out
        of the returned list. Another error is raised once every leader has answered (the
        first one)."""
        ok, failed = self._gather(replicas, lambda r: getattr(r.leader, method).remote(*args), method)
        if failed:
            raise failed[0][1]
        return ok

    def _gather(self, replicas: list[Replica], call: Callable[[Replica], Any], what: str
                ) -> tuple[list[Replica], list[tuple[Replica, BaseException]]]:
        """`call(replica)` (a Ray ref, or a list of them) issued for every replica, then each
        awaited: the replicas whose calls all returned, and (replica, error) for the others. A
        replica whose actor died goes to recovery and is in neither list."""
        refs = [(r, call(r)) for r in replicas]
        ok, failed = [], []
        for replica, ref in refs:
            try:
                ray.get(ref)
                ok.append(replica)
            except RayActorError as e:
                self._replica_failed(replica.index, f"{type(e).__name__} during {what}")
            except Exception as e:  # noqa: BLE001 — the caller decides
                failed.append((replica, e))
        return ok, failed

    def _mark_stale(self, replicas: list[Replica], reason: str) -> None:
        """These replicas do not hold the controller's weights: no work until an update lands."""
        with self._cv:
            for replica in replicas:
                if self._state[replica.index] == ALIVE:
                    self._state[replica.index] = STALE
                    self._last_failure[replica.index] = reason
            self._cv.notify_all()
        if replicas:
            logger.error("replica(s) %s stale: %s", [r.index for r in replicas], reason)

    def _refresh_stale(self, replicas: list[Replica]) -> None:
        """After a weight update: a stale replica whose weights are now complete is alive."""
        for replica in replicas:
            if self._state[replica.index] != STALE:
                continue
            if ray.get(replica.leader.incomplete_reason.remote()) is None:
                with self._cv:
                    self._state[replica.index] = ALIVE
                    self._cv.notify_all()


def _destroy_quietly(replica: Replica) -> None:
    try:
        replica.destroy(graceful=False)
    except Exception as e:  # noqa: BLE001 — the rebuild's own error is the one to report
        logger.warning("removing the failed rebuild of replica %d: %s", replica.index, e)


def _describe(err: BaseException) -> str:
    """One line: the shard's own exception when Ray wraps it (RayTaskError.cause)."""
    cause = getattr(err, "cause", None) or err
    lines = str(cause).strip().splitlines() or [""]
    return f"{type(cause).__name__}: {lines[0]}"
