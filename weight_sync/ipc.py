"""Colocated transfer: the trainer exposes a bucket's memory, the shard maps it and copies.

On GPU a CUDA IPC handle of the trainer's bucket (same device); on CPU a POSIX shared-memory
block. Handles carry the host's boot id and are refused on any other host; a CUDA handle is
opened only through torch's own `rebuild_cuda_tensor` (the handle cannot name another function)."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Optional

import torch

from weight_sync.bucket import Bucket, BucketMeta


class IpcHandleError(RuntimeError):
    """An IPC handle cannot be opened here (other host, other GPU, or it is gone)."""


def host_id() -> str:
    """Identifies this machine (its boot), so a handle from another host is refused."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return str(uuid.getnode())


@dataclass(frozen=True)
class IpcHandle:
    meta: BucketMeta
    host: str
    shm_name: Optional[str] = None  # CPU: shared-memory block name
    cuda: Optional[tuple[Any, tuple]] = None  # GPU: torch's (rebuild fn, args) for the storage
    device_uuid: Optional[str] = None
    pid: int = 0  # exporting process


class IpcExport:
    """Trainer side: one bucket made reachable by other processes of this host (`flat` is the
    exported memory). Keep it alive until the receivers have copied, then `close()`."""

    def __init__(self, bucket: Bucket, copy: bool = True):
        meta, flat = bucket.meta, bucket.flat
        self._shm = None
        if flat.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor
            self.flat = flat
            self.handle = IpcHandle(meta, host_id(), cuda=reduce_tensor(flat),
                                    device_uuid=_device_uuid(flat.device), pid=os.getpid())
            return
        self._shm = shared_memory.SharedMemory(create=True, size=max(1, meta.nbytes))
        self.flat = (torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=meta.nbytes).view(meta.dtype)
                     if meta.nbytes else torch.empty(0, dtype=meta.dtype))
        if copy:
            self.flat.copy_(flat.reshape(-1))
        self.handle = IpcHandle(meta, host_id(), shm_name=self._shm.name, pid=os.getpid())

    @classmethod
    def staging(cls, meta: BucketMeta, device: torch.device) -> "IpcExport":
        """An exported bucket with undefined contents, to pack into on every push."""
        if device.type == "cuda":
            return cls(Bucket(meta, torch.empty(meta.numel, dtype=meta.dtype, device=device)))
        return cls(Bucket(meta, torch.empty(0, dtype=meta.dtype)), copy=False)

    def close(self) -> None:
        self.flat = None  # first: the shared-memory block cannot close while a view exports it
        if self._shm is not None:
            _close_shm(self._shm)
            self._shm.unlink()
            self._shm = None


class IpcImport:
    """Receiver side: a zero-copy tensor over the exporter's memory, valid until `close()`."""

    def __init__(self, handle: IpcHandle, device: torch.device):
        if handle.host != host_id():
            raise IpcHandleError("IPC handle comes from another host; IPC works only between processes "
                                 "of one machine (use the nccl or tensor transport across hosts)")
        self._shm = None
        if handle.cuda is not None:
            self.flat = self._open_cuda(handle, device)
        else:
            self.flat = self._open_shm(handle)

    def _open_cuda(self, handle: IpcHandle, device: torch.device) -> torch.Tensor:
        check_rebuild_fn(handle.cuda)
        if device.type != "cuda" or _device_uuid(device) != handle.device_uuid:
            raise IpcHandleError("CUDA IPC handle is for another GPU: the trainer must be colocated on "
                                 "the shard's GPU")
        return open_cuda_tensor(handle.cuda, device)

    def _open_shm(self, handle: IpcHandle) -> torch.Tensor:
        try:
            self._shm = shared_memory.SharedMemory(name=handle.shm_name)
        except FileNotFoundError:
            raise IpcHandleError(f"shared-memory block {handle.shm_name} is gone (trainer closed it?)") from None
        if handle.pid != os.getpid():
            _untrack(self._shm)
        raw = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=handle.meta.nbytes)
        return raw.view(handle.meta.dtype)

    def close(self) -> None:
        self.flat = None
        if self._shm is not None:
            _close_shm(self._shm)
            self._shm = None


def open_cuda_tensor(reduced: tuple[Any, tuple], device: torch.device) -> torch.Tensor:
    """Open one `reduce_tensor` result on `device` (the same GPU, checked by the caller): only
    torch's `rebuild_cuda_tensor` is called, with the device index as this process numbers that
    GPU (the trainer may see it under another index, e.g. with CUDA_VISIBLE_DEVICES)."""
    fn, args = check_rebuild_fn(reduced)
    args = tuple(args)
    if len(args) > _DEVICE_ARG and isinstance(args[_DEVICE_ARG], int) and device.index is not None:
        args = args[:_DEVICE_ARG] + (device.index,) + args[_DEVICE_ARG + 1:]
    return fn(*args)


def check_rebuild_fn(reduced: tuple[Any, tuple]) -> tuple[Any, tuple]:
    """A handle names the function the receiver calls: only torch's rebuild_cuda_tensor."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    fn, args = reduced
    if fn is not rebuild_cuda_tensor:
        raise IpcHandleError(f"CUDA IPC handle asks to call {getattr(fn, '__name__', fn)!r}; only "
                             "torch's rebuild_cuda_tensor is accepted")
    return fn, args


_DEVICE_ARG = 6  # rebuild_cuda_tensor(cls, size, stride, offset, storage_cls, dtype, device, ...)


def _device_uuid(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", device.index))


def _close_shm(shm: shared_memory.SharedMemory) -> None:
    """Unmap the block; if views of it are still alive somewhere, the mapping goes with them."""
    try:
        shm.close()
    except BufferError:
        pass


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """The exporter owns the block; stop this process's resource tracker from unlinking it."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # noqa: BLE001 — best effort; Python 3.13 has track=False instead
        pass
