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
    """Trainer side: one bucket made reachable by other processes of this host. Keep it alive
    until the receivers have copied, then `close()`."""

    def __init__(self, bucket: Bucket):
        flat = bucket.flat
        if flat.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor
            self._shm = None
            self._keep = flat
            self.handle = IpcHandle(bucket.meta, host_id(), cuda=reduce_tensor(flat),
                                    device_uuid=_device_uuid(flat.device))
            return
        nbytes = max(1, bucket.meta.nbytes)
        self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
        view = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=bucket.meta.nbytes)
        view.copy_(flat.contiguous().view(torch.uint8))
        del view
        self.handle = IpcHandle(bucket.meta, host_id(), shm_name=self._shm.name, pid=os.getpid())

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None
        self._keep = None


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
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        fn, args = handle.cuda
        if fn is not rebuild_cuda_tensor:  # the handle names the function we call: only torch's
            raise IpcHandleError(f"CUDA IPC handle asks to call {getattr(fn, '__name__', fn)!r}; only "
                                 "torch's rebuild_cuda_tensor is accepted")
        if device.type != "cuda" or _device_uuid(device) != handle.device_uuid:
            raise IpcHandleError("CUDA IPC handle is for another GPU: the trainer must be colocated on "
                                 "the shard's GPU")
        return fn(*args)

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
            self._shm.close()
            self._shm = None


def _device_uuid(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", device.index))


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """The exporter owns the block; stop this process's resource tracker from unlinking it."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # noqa: BLE001 — best effort; Python 3.13 has track=False instead
        pass
