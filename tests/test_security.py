"""Spec for security basics: every listener and rendezvous binds 127.0.0.1 unless an address is
given (then that address, never every interface); nothing under rollout/, actors/ or
weight_sync/ unpickles or `torch.load`s, and a pickle checkpoint is refused without running its
payload; IPC handles are accepted only from the same host, and a CUDA handle cannot name the
function the receiver calls. (The engine refusing `.bin` checkpoints by name is also in
tests/test_errors_core.py::test_pickle_checkpoint_refused.)"""
from __future__ import annotations

import ast
import dataclasses
import multiprocessing as mp
import os
import pickle
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from actors.shard import RolloutShard
from rollout import CheckpointError, Engine, EngineConfig, WeightUpdateError
from rollout.distributed import LOOPBACK, free_port, tcp_init_method
from rollout.tiny_model import TinyModelSpec, default_tiny_model_dir, make_tiny_model
from weight_sync import WeightSender
from weight_sync.bucket import pack_buckets
from weight_sync.ipc import IpcExport, IpcHandle, IpcHandleError, IpcImport, host_id
from weight_sync.ipc_layout import IpcLayout
from weight_sync.spec import TensorSpec
from weight_sync.process_group import GroupAddress, WeightSyncGroup

ROOT = Path(__file__).resolve().parents[1]
needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads listeners from Linux /proc")


# ---- listeners ----------------------------------------------------------------------------------
def listening_addresses(pid: str = "self") -> set[tuple[str, int]]:
    """(host, port) of every TCP socket this process listens on (from /proc: no psutil needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word little endian
            found.add((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def _tp_group_listeners(queue) -> None:
    """In a fresh process: the listeners a TP rendezvous (store + gloo groups) opens."""
    from rollout.distributed import destroy_tp_group, init_tp_group
    before = listening_addresses()
    init_tp_group(0, 1, tcp_init_method(free_port()), "gloo", timedelta(seconds=30))
    queue.put(sorted(listening_addresses() - before))
    destroy_tp_group()


@needs_proc
def test_tp_rendezvous_listens_on_loopback_only():
    assert tcp_init_method(free_port()).startswith("tcp://127.0.0.1:")
    assert RolloutShard.pick_init_method(None).startswith(f"tcp://{LOOPBACK}:")  # what leaders hand out
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_tp_group_listeners, args=(queue,))
    proc.start()
    opened = queue.get(timeout=120)
    proc.join(timeout=60)
    assert len(opened) >= 2, opened  # the store and gloo's listener at least
    assert {host for host, _ in opened} == {"127.0.0.1"}, opened


@needs_proc
@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"], ids=["default", "given"])
def test_weight_sync_group_listens_on_its_address_only(host):
    assert WeightSender.__init__.__kwdefaults__["host"] == "127.0.0.1"
    before = listening_addresses()
    group = WeightSyncGroup(GroupAddress(host, free_port(host), 1, "gloo", timeout_s=20), 0)
    opened = listening_addresses() - before
    group.destroy()
    assert len(opened) >= 2, opened
    assert {h for h, _ in opened} == {host}, opened


@needs_proc
def test_shard_push_channel_listens_on_loopback_only():
    """The IPC push channel a single-rank leader opens (`open_push_channel`): 127.0.0.1, an
    OS-chosen port, a fresh secret token; closed by the shard's shutdown."""
    shard = RolloutShard(EngineConfig(kv_cache_tokens=64), 0, 1)
    shard.engine = object()  # stands in for the leader's engine: the channel only needs a leader
    before = listening_addresses()
    info = shard.open_push_channel()
    opened = listening_addresses() - before
    try:
        assert opened == {("127.0.0.1", info.port)}, opened
        assert info.host == "127.0.0.1" and len(info.token) >= 64
        assert shard.open_push_channel() == info  # opened once
    finally:
        shard._push_channel.close()
    assert not listening_addresses() - before
    follower = RolloutShard(EngineConfig(kv_cache_tokens=64), 0, 2)
    follower.engine = object()
    with pytest.raises(RuntimeError, match="single-rank"):
        follower.open_push_channel()


# ---- no unpickling ---------------------------------------------------------------------------------
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
LOADERS = {("torch", "load"), ("numpy", "load"), ("torch.serialization", "load")}


def _unpickling_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    alias = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name] = a.name
                if a.name.split(".")[0] in PICKLE_MODULES:
                    found.append(f"{path}:{node.lineno} import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module.split(".")[0] in PICKLE_MODULES or (node.module, a.name) in LOADERS:
                    found.append(f"{path}:{node.lineno} from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = alias.get(node.value.id, node.value.id)
            if (module, node.attr) in LOADERS:
                found.append(f"{path}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_library_code_never_unpickles():
    files = [p for pkg in ("rollout", "actors", "weight_sync") for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 30
    assert [hit for f in files for hit in _unpickling_calls(f)] == []
    # the scanner does see what it looks for
    probe = ROOT / "tests" / "test_security.py"
    assert _unpickling_calls(probe) == [f"{probe}:{_line_of('import pickle')} import pickle"]


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line == text)


@dataclasses.dataclass
class _Payload:
    """Unpickling this creates `marker`: proof that a pickle was loaded."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("file_name", ["pytorch_model.bin", "model.safetensors"])
def test_pickle_checkpoint_refused_without_running_it(tmp_path, file_name):
    model = make_tiny_model(tmp_path / "m", TinyModelSpec(), with_tokenizer=False)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (model / file_name).write_bytes(pickle.dumps({"model.norm.weight": _Payload(marker)}))
    with pytest.raises(CheckpointError, match="pickle|not a readable safetensors file"):
        Engine(EngineConfig(model_path=str(model), kv_cache_tokens=64))
    engine = Engine(EngineConfig(kv_cache_tokens=64))
    with pytest.raises(WeightUpdateError, match="pickle|not a readable safetensors file"):
        engine.update_weights_from_disk(model)
    assert not marker.exists()


# ---- IPC handles --------------------------------------------------------------------------------
def test_ipc_handle_from_another_host_is_refused():
    engine = Engine(EngineConfig(kv_cache_tokens=64))
    weights = load_file(str(default_tiny_model_dir() / "model.safetensors"))
    export = IpcExport(pack_buckets(weights.items())[0])
    try:
        assert export.handle.host == host_id()
        IpcImport(export.handle, torch.device("cpu")).close()  # same host: opens
        forged = dataclasses.replace(export.handle, host="boot-id-of-another-machine")
        with pytest.raises(IpcHandleError, match="another host"):
            IpcImport(forged, torch.device("cpu"))
        with pytest.raises(WeightUpdateError, match="another host"):
            engine.update_weights_from_ipc([forged])
        assert engine.weight_version == 0 and engine.updater.incomplete_reason is None
        assert engine.update_weights_from_ipc([export.handle]) == 1  # the genuine handle lands
    finally:
        export.close()


def test_cuda_ipc_handle_cannot_name_the_function_called(tmp_path):
    marker = tmp_path / "called"
    meta = pack_buckets([("x", torch.ones(4))])[0].meta
    handle = IpcHandle(meta, host_id(), cuda=(Path.touch, (marker,)))
    with pytest.raises(IpcHandleError, match="only torch's rebuild_cuda_tensor"):
        IpcImport(handle, torch.device("cpu"))
    # a registered layout (the trainer's own tensors, or staging buckets) is held to the same rule
    engine = Engine(EngineConfig(kv_cache_tokens=64))
    spec = TensorSpec("model.norm.weight", (64,), torch.float32)
    norm = IpcHandle(pack_buckets([(spec.name, torch.ones(64))])[0].meta, host_id(),
                     cuda=(Path.touch, (marker,)))
    for layout in (IpcLayout("a", host_id(), 1, (spec,), tensors=((Path.touch, (marker,)),)),
                   IpcLayout("b", host_id(), 1, (spec,), buckets=(norm,))):
        with pytest.raises(WeightUpdateError, match="only torch's rebuild_cuda_tensor"):
            engine.update_weights_from_ipc(layout, allow_partial=True)
    assert not marker.exists() and engine.weight_version == 0
