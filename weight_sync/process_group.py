"""A standalone process group for weight sync (trainer = rank 0, every rollout shard a rank),
separate from any tensor-parallel group and from torch's default group: its own TCPStore,
its own timeout, so a dead trainer gives a clear error instead of a hang.

Listeners bind the group's address only: the rendezvous store's server listens on `host` (torch's
own TCPStore server would listen on every interface), and with a loopback address every gloo
rank binds loopback too. The default address everywhere is 127.0.0.1."""
from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


class WeightSyncGroupError(RuntimeError):
    """Rendezvous or a collective of the weight-sync group failed or timed out."""


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class GroupAddress:
    host: str  # the trainer's (rank 0's) address; 127.0.0.1 when everything is on one host
    port: int
    world_size: int
    backend: str = "gloo"  # "nccl" between GPUs
    group_name: str = "weight_sync"
    timeout_s: float = 60.0


class WeightSyncGroup:
    def __init__(self, addr: GroupAddress, rank: int):
        self.addr, self.rank = addr, rank
        timeout = datetime.timedelta(seconds=addr.timeout_s)
        try:
            if rank == 0:
                store = listening_store(addr.host, addr.port, addr.world_size, timeout)
            else:
                store = dist.TCPStore(addr.host, addr.port, addr.world_size, is_master=False,
                                      timeout=timeout)
            self.pg = _make_pg(dist.PrefixStore(addr.group_name, store), rank, addr, timeout)
        except Exception as e:  # noqa: BLE001 — every rendezvous failure becomes one typed error
            raise WeightSyncGroupError(
                f"weight-sync group {addr.group_name!r} rank {rank}/{addr.world_size} could not form at "
                f"{addr.host}:{addr.port} within {addr.timeout_s}s: {e}") from e
        self._store = store

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> "PendingBroadcast":
        """Start a broadcast; `.wait()` on the result before reading (receiver) or reusing
        (sender) `tensor`. On NCCL the wait only orders the current stream after it."""
        try:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            return PendingBroadcast(self, self.pg.broadcast([tensor], opts), tensor)
        except Exception as e:  # noqa: BLE001
            raise self._error(e) from e

    def _error(self, e: BaseException) -> "WeightSyncGroupError":
        return WeightSyncGroupError(f"broadcast in weight-sync group {self.addr.group_name!r} failed "
                                    f"(peer gone or timed out after {self.addr.timeout_s}s): {e}")

    def destroy(self) -> None:
        self.pg = None
        self._store = None


def listening_store(host: str, port: int, world_size: int, timeout: datetime.timedelta,
                    wait_for_workers: bool = True) -> dist.TCPStore:
    """The server side of a TCPStore rendezvous, listening on `host` only (a socket we bind and
    hand to torch; torch's own server would listen on every interface)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    # torch owns the descriptor from here on (it closes it with the store)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=wait_for_workers, master_listen_fd=sock.detach())


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _gloo_options(host: str, rank: int, timeout: datetime.timedelta):
    """Gloo options whose device binds `host` when every rank is on this host (loopback) or this
    is rank 0 (the given address is its own); other ranks bind their host's default address."""
    gloo = dist.ProcessGroupGloo
    opts = gloo._Options()  # noqa: SLF001 — the binding's options type (torch >= 1.x)
    opts._timeout = timeout  # noqa: SLF001
    bindable = host not in ("0.0.0.0", "::", "")
    use_host = bindable and (is_loopback(host) or rank == 0)
    device = gloo.create_device(hostname=host) if use_host else gloo.create_default_device()
    opts._devices = [device]  # noqa: SLF001
    return opts


def _make_pg(store, rank: int, addr: GroupAddress, timeout: datetime.timedelta):
    if addr.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, addr.world_size, _gloo_options(addr.host, rank, timeout))
    if addr.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, addr.world_size, opts)
    raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', got {addr.backend!r}")


class PendingBroadcast:
    def __init__(self, group: WeightSyncGroup, work, tensor: torch.Tensor):
        self.group, self.work, self.tensor = group, work, tensor

    def wait(self) -> torch.Tensor:
        try:
            self.work.wait()
        except Exception as e:  # noqa: BLE001
            raise self.group._error(e) from e  # noqa: SLF001
        return self.tensor
