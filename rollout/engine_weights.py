"""The Engine's weight-sync API (DESIGN.md §2 "Weight sync"): every path pauses generation at a
step boundary, treats in-flight requests by `pause_mode`, loads through the shard's
WeightUpdater, bumps the version, and resumes. A failed transfer aborts the in-flight requests
(returned with the tokens they have) and leaves the engine refusing to generate."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from rollout.errors import ConfigError
from weight_sync.bucket import Bucket, UpdateManifest, check_carried, named_tensor_dict
from weight_sync.ipc import IpcHandle
from weight_sync.ipc_layout import IpcLayout, IpcLayoutRef
from weight_sync.process_group import GroupAddress
from weight_sync.spec import TensorSpec
from weight_sync.update_args import check_pause_mode, next_version

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class EngineWeightsMixin:
    """Mixed into Engine; uses its `updater`, `gate`, `scheduler`, `config` and `_weights_lock`."""

    last_update_phases: dict = {}

    @property
    def weight_version(self) -> int:
        return self.scheduler.weight_version

    def check_weights_update(self, specs: Sequence[TensorSpec], allow_partial: bool = False) -> None:
        """Validate an update's names/shapes/dtypes without touching anything (a sender calls
        this before a broadcast, so a bad update fails before any byte moves)."""
        self.updater.validate(list(specs), allow_partial)

    def update_weights_from_tensor(self, weights: Union[NamedTensors, Sequence[Bucket]], *,
                                   version: Optional[int] = None, allow_partial: bool = False,
                                   pause_mode: Optional[str] = None) -> int:
        """`weights`: (HF name, full tensor) pairs, loaded from where they are (a GPU tensor is
        copied device to device into its parameter), or packed Buckets. Returns the new version."""
        weights = list(weights)
        if weights and not isinstance(weights[0], Bucket):
            tensors = {n: t.detach() for n, t in named_tensor_dict(weights).items()}
            # the dtypes every transport carries, so an update is refused alike on every path
            specs = check_carried(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items())
            return self.update_weights(
                lambda: self.updater.from_named(tensors, allow_partial), version, pause_mode,
                lambda: self.updater.validate(specs, allow_partial))
        return self.update_weights(lambda: self.updater.from_buckets(weights, allow_partial), version,
                                   pause_mode, self._precheck("tensor", weights, allow_partial))

    def update_weights_from_disk(self, path: Union[str, Path], *, version: Optional[int] = None,
                                 allow_partial: bool = False, pause_mode: Optional[str] = None) -> int:
        return self.update_weights(lambda: self.updater.from_disk(path, allow_partial), version,
                                   pause_mode, self._precheck("disk", path, allow_partial))

    def update_weights_from_ipc(self, handles: Union[IpcLayout, IpcLayoutRef, Sequence[IpcHandle]], *,
                                version: Optional[int] = None, allow_partial: bool = False,
                                pause_mode: Optional[str] = None) -> int:
        """`handles`: a registered layout (`IpcLayout`, opened and planned once), a push of one
        (`IpcLayoutRef`: the trainer's tensors hold the new values; an unknown id raises
        `IpcLayoutUnknownError` before generation is paused), or per-push bucket handles."""
        return self.update_weights(lambda: self.updater.from_ipc(handles, allow_partial), version,
                                   pause_mode, self._precheck("ipc", handles, allow_partial))

    def drop_ipc_layouts(self, layout_ids: Optional[Sequence[str]] = None) -> None:
        """Close registered IPC layouts (all when None): the trainer's memory is unmapped."""
        with self._weights_lock:
            self.updater.ipc_layouts.drop(layout_ids)

    def weight_sync_free_bytes(self) -> Optional[int]:
        """Free device memory of this engine's device (None on CPU): sizes a sender's buckets."""
        device = self.runner.device
        return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None

    @property
    def num_weight_sync_ranks(self) -> int:
        """Ranks this target adds to a weight-sync group (one per shard)."""
        return 1

    def init_weights_update_group(self, addr: GroupAddress, rank_offset: int = 1) -> None:
        """Join the trainer's weight-sync group (the trainer is rank 0) as rank `rank_offset` —
        a rendezvous: the trainer joins at the same time."""
        self.updater.join_group(addr, rank_offset)

    def destroy_weights_update_group(self) -> None:
        self.updater.leave_group()

    def update_weights_from_distributed(self, manifest: UpdateManifest, *, version: Optional[int] = None,
                                        allow_partial: bool = False,
                                        pause_mode: Optional[str] = None) -> int:
        return self.update_weights(lambda: self.updater.from_distributed(manifest, allow_partial),
                                   version, pause_mode, self._precheck("distributed", manifest,
                                                                       allow_partial))

    # ---- pause → update → resume --------------------------------------------------------------
    def update_weights(self, load: Callable[[], int], version: Optional[int] = None,
                       pause_mode: Optional[str] = None,
                       precheck: Optional[Callable[[], None]] = None) -> int:
        """`precheck()` → pause → `load()` → commit the new version → resume; returns the
        version. What `precheck` (and the arguments' checks) reject fails before generation
        pauses. The seconds of each phase are kept in `last_update_phases`."""
        with self._weights_lock:  # never while release_memory/resume_memory reshape the weights
            new_version = next_version(self.weight_version, version)
            check_pause_mode(pause_mode, ConfigError)
            if precheck is not None:
                precheck()
            t0 = time.perf_counter()
            self.pause_generation(pause_mode)
            t1 = time.perf_counter()
            try:
                load()
                self.commit_weight_version(new_version)
            except Exception:
                self.abort_if_incomplete()  # a shard left holding a mix serves nothing more
                raise
            finally:
                t2 = time.perf_counter()
                self.resume_generation()
                self.last_update_phases = {"pause": t1 - t0, "load": t2 - t1,
                                           "resume": time.perf_counter() - t2}
        return new_version

    # The steps of an update, for a controller that drives several shards through them.
    def pause_generation(self, pause_mode: Optional[str] = None) -> None:
        """Stop generation at a step boundary; in-flight requests are aborted, retracted (KV
        recomputed later under the new weights) or kept (`in_place`) by `pause_mode`."""
        mode = pause_mode or self.config.pause_mode
        check_pause_mode(mode, ConfigError)
        self.gate.pause()
        try:
            with self.gate.exclusive():  # (an abort from another thread waits for this)
                self.scheduler.drain()  # the step in flight finishes under the weights it started with
                if mode == "abort":
                    self.scheduler.abort_all()
                elif mode == "retract":
                    self.scheduler.retract_all()
        except BaseException:  # not left paused: the generate loop would wait forever
            self.gate.resume()
            raise

    def resume_generation(self) -> None:
        self.gate.resume()

    def commit_weight_version(self, version: int) -> None:
        self.scheduler.commit_weights(int(version))

    def abort_if_incomplete(self) -> None:
        """After a failed update: if this shard holds a mix of versions, end the in-flight
        requests now (returned with the tokens they have) rather than continue on mixed weights."""
        if self.updater.incomplete_reason is not None:
            with self.gate.exclusive():  # generation may be running (a controller's fence)
                self.scheduler.abort_all()

    def _precheck(self, kind: str, payload, allow_partial: bool) -> Callable[[], None]:
        return lambda: self.updater.precheck(kind, payload, allow_partial)

    @contextlib.contextmanager
    def paused(self, pause_mode: Optional[str] = None) -> Iterator[None]:
        self.pause_generation(pause_mode)
        try:
            yield
        finally:
            self.resume_generation()
