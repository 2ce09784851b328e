"""WeightSender: the trainer side. Packs HF-named full tensors into buckets and pushes them into
any target that has the `update_weights_*` methods (an Engine or a RolloutController) over one
of four transports. `push` returns the version the target now serves.

Without an explicit `bucket_bytes` the bucket size comes from the receiving side's free device
memory (`bucket_size.py`). The ipc transport registers the weight layout once
(`ipc_registry.py`) and then sends only the layout id per push."""
from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from weight_sync.bucket import UpdateManifest, pack, pack_buckets, plan_buckets
from weight_sync.bucket_size import resolve_bucket_bytes
from weight_sync.disk import save_atomic
from weight_sync.errors import WeightUpdateError
from weight_sync.ipc_layout import IpcLayoutUnknownError
from weight_sync.ipc_registry import IpcRegistry
from weight_sync.process_group import GroupAddress, WeightSyncGroup, free_port
from weight_sync.spec import specs_of
from weight_sync.update_args import check_pause_mode, next_version

logger = logging.getLogger(__name__)
TRANSPORTS = ("disk", "nccl", "tensor", "ipc")


@dataclass
class PushTimings:
    """Seconds spent in each phase of the last push."""

    pack: float = 0.0
    transfer: float = 0.0  # transfer + load as seen from the trainer
    total: float = 0.0
    nbytes: int = 0
    bucket_bytes: int = 0  # the bucket size in use (given, or chosen from free memory)
    extra: dict[str, float] = field(default_factory=dict)


class WeightSender:
    def __init__(self, target: Any, transport: str = "tensor", *, bucket_bytes: Optional[int] = None,
                 sync_dir: Optional[str] = None, host: str = "127.0.0.1", group_timeout_s: float = 60.0,
                 backend: Optional[str] = None, checksum: bool = False,
                 ipc_staging: Optional[bool] = None):
        """`bucket_bytes`: None picks it from the receivers' free device memory at the first push
        (`bucket_source` says how). `ipc_staging` (ipc on CUDA): None registers the trainer's own
        tensors and switches to staging buckets if they move every push; True always stages.
        `checksum`: a CRC32 per bucket (tensor transport); registered ipc layouts are read in
        place from the trainer's memory and carry none."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.target, self.transport = target, transport
        self.bucket_bytes: Optional[int] = None
        self.bucket_source = ""
        if bucket_bytes is not None:
            self.bucket_bytes, self.bucket_source = resolve_bucket_bytes(target, bucket_bytes)
        self.ipc_staging = ipc_staging
        self._ipc: Optional[IpcRegistry] = None
        self.host, self.group_timeout_s, self.backend, self.checksum = host, group_timeout_s, backend, checksum
        self._own_dir = sync_dir is None
        self.sync_dir = Path(sync_dir or tempfile.mkdtemp(prefix="weight-sync-"))
        self.group: Optional[WeightSyncGroup] = None
        self.last = PushTimings()
        self._manifest_key: Optional[tuple] = None
        self._manifest: Optional[UpdateManifest] = None
        self._pause_mode: Optional[str] = None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: Optional[int] = None,
             allow_partial: bool = False, pause_mode: Optional[str] = None) -> int:
        """Send every (HF name, full tensor); returns the target's new weight version.
        `pause_mode` (abort | retract | in_place) overrides the target's for this update."""
        check_pause_mode(pause_mode)  # both before any byte moves
        version = next_version(self.target.weight_version, version)
        self._pause_mode = pause_mode
        if self.transport == "ipc":  # the registry checks (and, to register, detaches) them
            named = named_tensors if isinstance(named_tensors, list) else list(named_tensors)
        else:
            named = [(n, t.detach()) for n, t in named_tensors]
        start = time.perf_counter()
        if self.bucket_bytes is None and self.transport != "disk":  # disk writes files, not buckets
            self.bucket_bytes, self.bucket_source = resolve_bucket_bytes(self.target, None)
        self.last = PushTimings(bucket_bytes=self.bucket_bytes or 0)
        if self.transport != "ipc":  # ipc: the registration's size
            self.last.nbytes = sum(t.numel() * t.element_size() for _, t in named)
        new_version = getattr(self, f"_push_{self.transport}")(named, version, allow_partial)
        self.last.total = time.perf_counter() - start
        return new_version

    # ---- transports ----------------------------------------------------------------------------
    def _push_tensor(self, named, version, allow_partial) -> int:
        t0 = time.perf_counter()
        buckets = pack_buckets(named, self.bucket_bytes, torch.device("cpu"), self.checksum)
        self.last.pack = time.perf_counter() - t0
        return self._timed(lambda: self.target.update_weights_from_tensor(
            buckets, version=version, allow_partial=allow_partial,
            pause_mode=self._pause_mode))

    def _push_disk(self, named, version, allow_partial) -> int:
        t0 = time.perf_counter()
        path = save_atomic(named, self.sync_dir / f"v{version}")
        self.last.pack = time.perf_counter() - t0
        try:
            return self._timed(lambda: self.target.update_weights_from_disk(
                str(path), version=version, allow_partial=allow_partial,
            pause_mode=self._pause_mode))
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def _push_ipc(self, named, version, allow_partial) -> int:
        """The layout is registered once (receivers open it and plan their copies); a push
        then sends its id. A receiver without it (rebuilt replica) is sent the layout again."""
        t0 = time.perf_counter()
        if self._ipc is None:
            self._ipc = IpcRegistry(self.bucket_bytes, self.ipc_staging)
            weakref.finalize(self, self._ipc.close)  # a sender never closed still frees its blocks
        registrations = self._ipc.registrations
        reg = self._ipc.prepare(named, allow_partial)
        self.last.pack = time.perf_counter() - t0  # registration, or a pointer check + sync / staging copy
        self.last.nbytes = reg.nbytes
        if self._ipc.registrations != registrations:
            self.last.extra["register"] = self.last.pack

        def send(payload) -> int:
            return self._timed(lambda: self.target.update_weights_from_ipc(
                payload, version=version, allow_partial=allow_partial, pause_mode=self._pause_mode))
        if not reg.confirmed:
            result = send(reg.layout)
            self._ipc.confirm(reg)
            return result
        try:  # a RolloutController sends the id over its replicas' push channels (no Ray call)
            result = send(reg.layout.ref)
            if getattr(self.target, "last_ipc_path", "") == "channel":
                self.last.extra["channel"] = 1.0
            return result
        except IpcLayoutUnknownError as e:
            logger.info("re-registering IPC layout %s: %s", reg.layout.layout_id, e)
            self.last.extra["reregistered"] = 1.0
            return send(reg.layout)

    def _push_nccl(self, named, version, allow_partial) -> int:
        if not named:  # nothing to broadcast: a version bump, as the tensor path does it
            return self._push_tensor(named, version, allow_partial)
        tensors = dict(named)
        manifest = self._checked_manifest(specs_of(named), allow_partial)
        self._ensure_group(next(iter(tensors.values())).device)
        try:
            return self._broadcast(manifest, tensors, version, allow_partial)
        except BaseException:
            self._drop_group()
            raise

    def _drop_group(self) -> None:
        """After a failed broadcast either side's group may be broken (a receiver that refused
        the update never took part in its collectives): both leave it, and the next push makes
        a new one instead of failing on the old one for good."""
        group, self.group = self.group, None
        if group is not None:
            group.destroy()
        try:
            self.target.destroy_weights_update_group()
        except Exception as e:  # noqa: BLE001 — the push's own error is the one to raise
            logger.warning("destroy_weights_update_group after a failed push: %s", e)

    def _broadcast(self, manifest: UpdateManifest, tensors: dict, version: int,
                   allow_partial: bool) -> int:
        device = next(iter(tensors.values())).device
        t0 = time.perf_counter()
        receiver = _Call(lambda: self.target.update_weights_from_distributed(
            manifest, version=version, allow_partial=allow_partial,
            pause_mode=self._pause_mode))
        in_flight: list = []
        try:
            for meta in manifest.buckets:  # pack bucket i+1 while bucket i is on the wire
                if len(in_flight) == 2:
                    in_flight.pop(0).wait()
                in_flight.append(self.group.broadcast_async(pack(meta, tensors, device).flat, src=0))
            for pending in in_flight:
                pending.wait()
        finally:
            result = receiver.join()
        self.last.transfer = time.perf_counter() - t0
        return result

    # ---- helpers ------------------------------------------------------------------------------
    def _checked_manifest(self, specs, allow_partial: bool) -> UpdateManifest:
        """The bucket plan, validated by the target before any byte moves (a receiver that
        refused mid-broadcast would leave the sender waiting). Pushes of an unchanged layout —
        every RL step — reuse both: validation is one RPC per layout, not per push."""
        key = (tuple(specs), allow_partial, self.bucket_bytes)
        if self._manifest_key != key:
            self.target.check_weights_update(specs, allow_partial)
            self._manifest = UpdateManifest(plan_buckets(specs, self.bucket_bytes))
            self._manifest_key = key
        return self._manifest

    def _timed(self, fn) -> int:
        t0 = time.perf_counter()
        out = fn()
        self.last.transfer = time.perf_counter() - t0
        return out

    def _ensure_group(self, device: torch.device) -> None:
        if self.group is not None:
            return
        backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds this rank to the tensors' GPU
        world = 1 + self.target.num_weight_sync_ranks
        addr = GroupAddress(self.host, free_port(self.host), world, backend, timeout_s=self.group_timeout_s)
        joiner = _Call(lambda: self.target.init_weights_update_group(addr, 1))
        self.group = WeightSyncGroup(addr, 0)
        joiner.join()

    def close(self) -> None:
        if self._ipc is not None:
            ids = self._ipc.close()
            try:  # receivers unmap the trainer's memory
                if ids:
                    self.target.drop_ipc_layouts(ids)
            except Exception as e:  # noqa: BLE001 — closing must not mask the caller's error
                logger.warning("drop_ipc_layouts failed: %s", e)
        if self.group is not None:
            try:
                self.target.destroy_weights_update_group()
            except Exception as e:  # noqa: BLE001 — closing must not mask the caller's error
                logger.warning("destroy_weights_update_group failed: %s", e)
            self.group.destroy()
            self.group = None
        if self._own_dir:
            shutil.rmtree(self.sync_dir, ignore_errors=True)


class _Call:
    """Runs `fn` in a thread (the receiving side of a collective the caller takes part in)."""

    def __init__(self, fn):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 — re-raised in join()
            self._error = e

    def join(self):
        self._thread.join()
        if self._error is not None:
            if isinstance(self._error, WeightUpdateError):
                raise self._error
            raise WeightUpdateError(f"the receiving side failed: {self._error}") from self._error
        return self._result
