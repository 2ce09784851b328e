"""Registered IPC layouts: the messages of the fast colocated path, and how a receiver opens one.

A trainer registers a weight *layout* once: either its own tensors (`tensors`: one CUDA IPC
handle per tensor, from torch's `reduce_tensor` — storage handle + offset, no packing copy) or
staging buckets it packs into on every push (`buckets`: CUDA IPC or, on CPU, POSIX shared
memory, the existing `IpcHandle`s). Receivers open the handles once and keep the views; later
pushes send only an `IpcLayoutRef` (the layout id). A receiver that does not hold the layout
raises `IpcLayoutUnknownError`, and the sender registers again.

A layout opened in the process that exported it (an Engine in the trainer's own process) takes
the exported tensors directly: CUDA cannot open a process's own IPC handles. That also lets an
in-process CPU engine read the trainer's own CPU tensors (`ipc_staging=False`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from weight_sync.bucket import views
from weight_sync.errors import WeightUpdateError
from weight_sync.ipc import (IpcHandle, IpcHandleError, IpcImport, _device_uuid, check_rebuild_fn, host_id,
                             open_cuda_tensor)
from weight_sync.spec import TensorSpec

# layout id -> the exporting tensors, for a receiver in the exporting process itself
_LOCAL: dict[str, list[torch.Tensor]] = {}


class IpcLayoutUnknownError(WeightUpdateError):
    """The receiver holds no layout with this id (never registered, evicted, or a rebuilt
    replica): nothing was written; the sender registers the layout again."""


@dataclass(frozen=True)
class IpcLayoutRef:
    """A push of a registered layout: the trainer's tensors hold the new values."""

    layout_id: str


@dataclass(frozen=True)
class IpcLayout:
    """A registration: everything a receiver needs to open the layout's memory once."""

    layout_id: str
    host: str
    pid: int
    specs: tuple[TensorSpec, ...]
    tensors: tuple[Any, ...] = ()  # direct: torch's (rebuild_cuda_tensor, args) per spec (None:
    #                                a CPU tensor, readable in the exporting process only)
    buckets: tuple[IpcHandle, ...] = ()  # staged: the staging buckets (their metas give the specs)
    device_uuid: Optional[str] = None
    replaces: tuple[str, ...] = ()  # the sender's earlier layouts, dropped once this one lands

    @property
    def ref(self) -> IpcLayoutRef:
        return IpcLayoutRef(self.layout_id)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def register_local(layout_id: str, tensors: list[torch.Tensor]) -> None:
    _LOCAL[layout_id] = tensors


def unregister_local(layout_id: str) -> None:
    _LOCAL.pop(layout_id, None)


class OpenedLayout:
    """Receiver side: the layout's source tensors (zero-copy views of the trainer's memory),
    in `layout.specs` order, valid until `close()`."""

    def __init__(self, layout: IpcLayout, device: torch.device):
        if layout.host != host_id():
            raise IpcHandleError("IPC layout comes from another host; IPC works only between processes "
                                 "of one machine (use the nccl or tensor transport across hosts)")
        self.layout = layout
        self._imports: list[IpcImport] = []
        try:
            self.sources = self._open(layout, device)
        except BaseException:
            self.close()
            raise
        for spec, t in zip(layout.specs, self.sources):
            if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
                self.close()
                raise WeightUpdateError(f"IPC tensor {spec.name!r} opened as {t.dtype} {tuple(t.shape)}, "
                                        f"its layout says {spec.dtype} {tuple(spec.shape)}")

    def _open(self, layout: IpcLayout, device: torch.device) -> list[torch.Tensor]:
        for reduced in [h for h in layout.tensors if h is not None] + [h.cuda for h in layout.buckets if h.cuda]:
            check_rebuild_fn(reduced)  # before anything else: a handle cannot name what we call
        cuda = any(h is not None for h in layout.tensors) or any(h.cuda is not None for h in layout.buckets)
        if cuda and (device.type != "cuda" or _device_uuid(device) != layout.device_uuid):
            raise IpcHandleError("CUDA IPC handle is for another GPU: the trainer must be colocated on "
                                 "the shard's GPU")
        local = None
        if layout.pid == os.getpid() and (cuda or layout.tensors):  # the exporter's own process:
            local = _LOCAL.get(layout.layout_id)                   # its tensors themselves
            if local is None:
                raise IpcHandleError(f"layout {layout.layout_id} was closed by its sender")
        if layout.buckets:
            if local is None:
                for h in layout.buckets:
                    self._imports.append(IpcImport(h, device))
                local = [imp.flat for imp in self._imports]
            return [t for h, flat in zip(layout.buckets, local) for _, t in views(h.meta, flat)]
        if len(layout.tensors) != len(layout.specs):
            raise WeightUpdateError(f"IPC layout has {len(layout.tensors)} handles for "
                                    f"{len(layout.specs)} tensors")
        if local is not None:
            return list(local)
        if not cuda:
            raise IpcHandleError("a layout of the trainer's own CPU tensors can be read only in the "
                                 "trainer's process; use staging (the default on CPU)")
        return [open_cuda_tensor(reduced, device) for reduced in layout.tensors]

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, t) for s, t in zip(self.layout.specs, self.sources)]

    def close(self) -> None:
        self.sources = []
        for imp in self._imports:
            imp.close()
        self._imports = []
