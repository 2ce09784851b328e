"""WeightUpdater: the rollout side of weight sync, one per shard.

Every path validates the whole update (names, shapes, dtypes; checksums and finiteness where
the bytes are already here) against the shard's parameter table before the first write, then
loads through the model's in-place `load_weights`. A failure after the first write marks the
shard incomplete: its engine refuses to generate until a complete update lands. Registered IPC
layouts (`ipc_receiver.py`) are validated once, when registered; their pushes replay a copy plan
recorded from that same load path."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Iterable, Optional, Protocol, Sequence, Union

import torch

from weight_sync import checkpoint
from weight_sync.bucket import Bucket, BucketMeta, UpdateManifest, verify, views
from weight_sync.errors import WeightUpdateError
from weight_sync.ipc import IpcHandle, IpcHandleError, IpcImport
from weight_sync.ipc_layout import IpcLayout, IpcLayoutRef
from weight_sync.ipc_receiver import IpcLayouts
from weight_sync.process_group import GroupAddress, WeightSyncGroup, WeightSyncGroupError
from weight_sync.spec import TensorSpec

logger = logging.getLogger(__name__)
LOADING = "a weight update is in progress"  # incomplete_reason during a write phase


class WeightTarget(Protocol):
    """What the updater drives: a ModelRunner shard."""

    device: torch.device

    def validate_weights(self, specs: Iterable[TensorSpec], error: type[Exception], *,
                         complete: bool = False, exact_dtype: bool = True) -> None: ...

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> int: ...

    def weights_changed(self) -> None:
        """Drop anything derived from the weights' values (packed copies): a write phase begins
        or ends. Registered-IPC copy plans write parameter storage without `load_weights`."""


class WeightUpdater:
    def __init__(self, target: WeightTarget, check_finite: bool = False):
        self.target, self.check_finite = target, check_finite
        self.incomplete_reason: Optional[str] = None
        self._reason_changed = threading.Condition()  # wait_until_loaded's
        self.group: Optional[WeightSyncGroup] = None
        self.ipc_layouts = IpcLayouts()

    # ---- validation --------------------------------------------------------------------------
    def validate(self, specs: Sequence[TensorSpec], allow_partial: bool, exact_dtype: bool = True) -> None:
        self.target.validate_weights(specs, WeightUpdateError, complete=not allow_partial,
                                     exact_dtype=exact_dtype)

    def _check_bytes(self, meta: BucketMeta, flat: torch.Tensor) -> None:
        if not isinstance(flat, torch.Tensor) or flat.dtype != meta.dtype or flat.numel() != meta.numel:
            got = f"{flat.dtype} x {flat.numel()}" if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise WeightUpdateError(f"bucket data is {got}, its metadata says {meta.dtype} x {meta.numel}")
        if not verify(meta, flat):
            names = [e.name for e in meta.entries][:3]
            raise WeightUpdateError(f"bucket holding {names}... failed its checksum: corrupted in transfer")
        if self.check_finite and flat.is_floating_point() and not bool(torch.isfinite(flat).all()):
            bad = next(n for n, t in views(meta, flat) if not bool(torch.isfinite(t).all()))
            raise WeightUpdateError(f"tensor {bad!r} holds NaN or inf (check_finite is on)")

    # ---- paths -------------------------------------------------------------------------------
    def from_buckets(self, buckets: Sequence[Bucket], allow_partial: bool = False) -> int:
        """Tensor passing: the buckets' bytes are here already, so everything is checked first."""
        self.validate([s for b in buckets for s in b.meta.specs()], allow_partial)
        for b in buckets:
            self._check_bytes(b.meta, b.flat)
        device = self.target.device
        # one host-to-device copy per bucket, then views (not one copy per parameter)
        on_device = (Bucket(b.meta, b.flat.to(device, non_blocking=True)) for b in buckets)
        return self._load(((n, t) for b in on_device for n, t in b.tensors()), allow_partial)

    def from_named(self, tensors: dict[str, torch.Tensor], allow_partial: bool = False) -> int:
        """Tensors in this process (an Engine's caller): checked, then loaded straight from
        where they are — a device tensor is one device-to-device copy into its parameter, with
        no bucket staged on the host on the way (31 GB took 31 s through host buckets)."""
        self.validate([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()],
                      allow_partial)
        if self.check_finite:
            bad = next((n for n, t in tensors.items()
                        if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
            if bad is not None:
                raise WeightUpdateError(f"tensor {bad!r} holds NaN or inf (check_finite is on)")
        return self._load(iter(tensors.items()), allow_partial)

    def from_disk(self, path: str | Path, allow_partial: bool = False) -> int:
        files = checkpoint.checkpoint_files(path)
        self.validate(checkpoint.read_specs(files), allow_partial, exact_dtype=False)
        return self._load(checkpoint.iter_slices(files), allow_partial)

    def from_ipc(self, payload: Union[IpcLayout, IpcLayoutRef, Sequence[IpcHandle]],
                 allow_partial: bool = False) -> int:
        """A registered layout (`IpcLayout`: validated, opened and planned once, then loaded),
        a push of one (`IpcLayoutRef`: a lookup and the copy plan, nothing re-validated), or
        per-push bucket handles (opened, checked and loaded each time)."""
        if isinstance(payload, (IpcLayout, IpcLayoutRef)):
            return self._from_layout(payload, allow_partial)
        handles = payload
        self.validate([s for h in handles for s in h.meta.specs()], allow_partial)
        opened = []
        try:
            for h in handles:
                opened.append(IpcImport(h, self.target.device))
                self._check_bytes(h.meta, opened[-1].flat)
            return self._load(((n, t) for h, o in zip(handles, opened) for n, t in views(h.meta, o.flat)),
                              allow_partial)
        except IpcHandleError as e:
            raise WeightUpdateError(str(e)) from e
        finally:
            for o in opened:
                o.close()

    def _from_layout(self, payload: Union[IpcLayout, IpcLayoutRef], allow_partial: bool) -> int:
        if isinstance(payload, IpcLayout):
            layout = self.ipc_layouts.register(payload, self.target, allow_partial, self.validate)
        else:
            layout = self.ipc_layouts.get(payload, allow_partial)
            self.target.validate_weights((), WeightUpdateError)  # only: the weights are resident
        if self.check_finite:
            bad = next((n for n, t in layout.opened.named()
                        if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
            if bad is not None:
                raise WeightUpdateError(f"tensor {bad!r} holds NaN or inf (check_finite is on)")
        self._begin(allow_partial)
        try:
            count = layout.load(self.target)
        except Exception as e:  # noqa: BLE001 — the shard now holds a mix: say so and refuse
            self._fail(f"loading failed after the first write: {e}")
            raise WeightUpdateError(self.incomplete_reason) from e
        return self._done(count, allow_partial)

    def precheck(self, kind: str, payload, allow_partial: bool = False) -> None:
        """What can be checked before generation pauses, without moving the update's bytes or
        writing anything: names, shapes and dtypes against this shard's parameter table, that the
        checkpoint is there, that a pushed IPC layout is registered here, that a broadcast has a
        group. A bad update fails here, so no in-flight request is paused or aborted for it.
        Tensor payloads may be Buckets or (BucketMeta, anything) pairs (a controller's, whose
        bytes are still in the object store)."""
        if kind == "tensor":
            metas = [b.meta if isinstance(b, Bucket) else b[0] for b in payload]
            self.validate([s for m in metas for s in m.specs()], allow_partial)
        elif kind == "disk":
            specs = checkpoint.read_specs(checkpoint.checkpoint_files(payload))
            self.validate(specs, allow_partial, exact_dtype=False)
        elif kind == "ipc":
            if isinstance(payload, IpcLayoutRef):
                self.ipc_layouts.get(payload, allow_partial)
            elif isinstance(payload, IpcLayout):
                self.validate(list(payload.specs), allow_partial)
            else:
                self.validate([s for h in payload for s in h.meta.specs()], allow_partial)
        elif kind == "distributed":
            self._require_group()
            self.validate(payload.specs(), allow_partial)
        else:
            raise WeightUpdateError(f"update kind must be one of {UPDATE_KINDS}, got {kind!r}")

    def _require_group(self) -> None:
        if self.group is None:
            raise WeightUpdateError("no weight-sync group: call init_weights_update_group first")

    def join_group(self, addr: GroupAddress, rank: int) -> None:
        if self.group is not None:
            self.group.destroy()
        try:
            self.group = WeightSyncGroup(addr, rank)
        except WeightSyncGroupError as e:
            raise WeightUpdateError(str(e)) from e

    def leave_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def from_distributed(self, manifest: UpdateManifest, allow_partial: bool = False) -> int:
        """Receive each bucket by broadcast from the trainer (rank 0), check it, load it."""
        self._require_group()
        self.validate(manifest.specs(), allow_partial)
        self._begin(allow_partial)
        count, buckets, i = 0, manifest.buckets, 0
        try:
            # double buffer: bucket i+1 is on the wire while bucket i is checked and loaded
            pending = self._receive(buckets[0]) if buckets else None
            for i, meta in enumerate(buckets):
                flat = pending.wait()
                pending = self._receive(buckets[i + 1]) if i + 1 < len(buckets) else None
                self._check_bytes(meta, flat)
                count += self.target.load_weights(views(meta, flat))
        except Exception as e:  # noqa: BLE001 — the trainer died, a bucket was bad, or a copy or
            # an allocation failed: the shard may hold a mix either way, so say so and refuse
            self._fail(f"broadcast update stopped at bucket {i + 1}/{len(manifest.buckets)}: {e}")
            raise WeightUpdateError(self.incomplete_reason) from e
        return self._done(count, allow_partial)

    def _receive(self, meta: BucketMeta):
        flat = torch.empty(meta.numel, dtype=meta.dtype, device=self.target.device)
        return self.group.broadcast_async(flat, src=0)

    def receive_raw(self, numel: int, dtype: torch.dtype) -> float:
        """Benchmarks: one plain broadcast of `numel` elements into this shard (the wire floor);
        returns the seconds this side waited."""
        import time
        flat = torch.empty(numel, dtype=dtype, device=self.target.device)
        t0 = time.perf_counter()
        self.group.broadcast(flat, src=0)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        return time.perf_counter() - t0

    # ---- the write phase ---------------------------------------------------------------------
    def _load(self, weights, allow_partial: bool) -> int:
        self._begin(allow_partial)
        try:
            count = self.target.load_weights(weights)
        except Exception as e:  # noqa: BLE001 — the shard now holds a mix: say so and refuse
            self._fail(f"loading failed after the first write: {e}")
            raise WeightUpdateError(self.incomplete_reason) from e
        return self._done(count, allow_partial)

    @property
    def loading(self) -> bool:
        """A write phase is under way."""
        return self.incomplete_reason == LOADING

    def wait_until_loaded(self, timeout_s: float) -> bool:
        """Until no write phase is under way (a caller that would be refused only for the
        moment an update loads waits for it); False if one still is after `timeout_s`."""
        with self._reason_changed:
            return self._reason_changed.wait_for(lambda: not self.loading, timeout_s)

    def _set_reason(self, reason: Optional[str]) -> None:
        with self._reason_changed:
            self.incomplete_reason = reason
            self._reason_changed.notify_all()

    def _begin(self, allow_partial: bool) -> None:
        self.target.weights_changed()
        self._was_incomplete = self.incomplete_reason
        self._set_reason(LOADING)

    def _done(self, count: int, allow_partial: bool) -> int:
        self.target.weights_changed()
        # A partial update on top of an incomplete shard leaves it incomplete.
        self._set_reason(self._was_incomplete if allow_partial else None)
        return count

    def mark_incomplete(self, reason: str, log: bool = True) -> None:
        """This shard must not serve until a complete update lands: another shard of its replica
        failed mid-update, its weights were released, or it was rebuilt with stale weights."""
        self._fail(reason, log)

    def _fail(self, reason: str, log: bool = True) -> None:
        self.target.weights_changed()
        self._set_reason(f"weights are incomplete ({reason}); generation is refused until a "
                         "complete update lands")
        if log:
            logger.error(self.incomplete_reason)


UPDATE_KINDS = ("tensor", "disk", "ipc", "distributed")


def apply_update(updater: WeightUpdater, kind: str, payload, allow_partial: bool = False) -> int:
    """One entry point for every transport (what a remote shard is asked to do): `payload` is
    the buckets, the checkpoint path, the IPC handles (or registered layout / layout ref), or
    the manifest."""
    if kind == "tensor":
        return updater.from_buckets(payload, allow_partial)
    if kind == "disk":
        return updater.from_disk(payload, allow_partial)
    if kind == "ipc":
        return updater.from_ipc(payload, allow_partial)
    if kind == "distributed":
        return updater.from_distributed(payload, allow_partial)
    raise ValueError(f"update kind must be one of {UPDATE_KINDS}, got {kind!r}")
