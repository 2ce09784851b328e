"""Tensor-parallel process-group state: who this rank is and how it talks to its peers.

A `TPGroup` is passed explicitly to every parallel layer (never a module global), so a process
can hold several engines and a test can build a sharded layer without any distributed set-up.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from rollout.errors import DistributedInitError
from weight_sync.process_group import is_loopback, listening_store

LOOPBACK = "127.0.0.1"
# The metadata group waits as long as the leader is idle (between generate calls, during
# training), so its timeout is far longer than the activation group's.
METADATA_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class TPGroup:
    """One tensor-parallel group. `group` carries activations (NCCL on GPU, gloo on CPU);
    `cpu_group` (gloo) carries the leader's per-step batch metadata."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None
    cpu_group: Optional[Any] = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (over the CPU group): every rank gets the same."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def shard_range(self, full: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of `full` items."""
        if full % self.size:
            raise ValueError(f"{full} items do not split evenly over tp_size={self.size}")
        per = full // self.size
        return self.rank * per, per


SINGLE = TPGroup()


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on `host` now (the OS picks it; the leader calls this)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_init_method(port: int, host: str = LOOPBACK) -> str:
    return f"tcp://{host}:{port}"


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_tp_group(rank: int, size: int, init_method: str, backend: str = "gloo",
                  timeout: timedelta = timedelta(seconds=120)) -> TPGroup:
    """Join the tensor-parallel world of this process: the default process group (`backend`,
    carries activations) plus a gloo group for the leader's batch metadata.

    Every rank must call this with the same `init_method` (the leader's `tcp://host:port`).
    A peer that does not arrive within `timeout` raises DistributedInitError (never a hang).
    A weight-sync group, if any, is created later with its own store and is not touched here."""
    if dist.is_initialized():
        raise DistributedInitError("this process already has a default process group; "
                                   "one TP shard per process")
    try:
        host, port = _tcp_address(init_method)
        store = (listening_store(host, port, size, timeout) if rank == 0 else
                 dist.TCPStore(host, port, size, is_master=False, timeout=timeout))
        with _gloo_on_loopback(is_loopback(host)):
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
            cpu_group = dist.new_group(backend="gloo", timeout=METADATA_TIMEOUT)
    except Exception as e:  # DistStoreError / DistNetworkError / RuntimeError from c10d
        destroy_tp_group()
        raise DistributedInitError(
            f"TP rank {rank}/{size}: rendezvous at {init_method} ({backend}) failed within "
            f"{timeout.total_seconds():.0f}s: {e}. Check that all {size} ranks started and can "
            "reach the leader's port.") from e
    return TPGroup(rank, size, dist.group.WORLD, cpu_group)


def _tcp_address(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    return url.hostname, url.port


@contextlib.contextmanager
def _gloo_on_loopback(loopback: bool) -> Iterator[None]:
    """Gloo picks its listening interface from $GLOO_SOCKET_IFNAME (else the hostname's
    address): for a group whose rendezvous is on loopback, point it at the loopback interface
    while the groups are made, so nothing of a TP group listens beyond this host."""
    names = {name for _, name in socket.if_nameindex()} if loopback else set()
    iface = next((n for n in ("lo", "lo0") if n in names), None)
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    try:
        yield
    finally:
        if iface is not None:
            if old is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = old


def destroy_tp_group() -> None:
    """Leave the TP world (no-op if this process has none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
