"""Spec for the push channel (issue #7): registered IPC pushes into single-rank replicas skip
the Ray call. Oracle: after every push over the channel, each replica's weights equal those of
an in-process engine that took the trainer's tensors through the ordinary load path (bit for
bit), its logits equal the trainer's, and the controller and every shard serve the pushed
version. A wrong token is refused before any request is read; a broken channel or a killed
shard makes that push go through Ray (nothing lost); an unknown layout registers again through
Ray; typed errors propagate as on the Ray path."""
from __future__ import annotations

import socket
import time

import pytest
import ray
import torch

from actors import RolloutController
from rollout import Engine, EngineConfig, WeightUpdateError
from tests.helpers import hf_model
from tests.ray_helpers import local_ray
from tests.test_weight_sync import PROMPTS, hf_logits, perturb
from weight_sync import WeightSender
from weight_sync.push_channel import (PushChannelClient, PushChannelError, PushChannelInfo, PushChannelServer,
                                      push_request, recv_message, send_message)

ARCH = "LlamaForCausalLM"


# ---- the channel alone ---------------------------------------------------------------------------
class _Recorder:
    def __init__(self, fail: Exception | None = None):
        self.calls, self.fail = [], fail

    def __call__(self, layout_id, version, allow_partial, pause_mode):
        self.calls.append((layout_id, version, allow_partial, pause_mode))
        if self.fail is not None:
            raise self.fail
        return {"version": version, "incomplete": False}


def test_push_ping_and_typed_errors():
    handler = _Recorder()
    server = PushChannelServer(handler)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        client = PushChannelClient(server.info)
        assert client.call({"op": "ping"}) == {"ok": True} and handler.calls == []
        assert client.call(push_request("abc", 7, False, "retract")) == {"ok": True, "version": 7,
                                                                        "incomplete": False}
        assert handler.calls == [("abc", 7, False, "retract")]
        for bad in ({"op": "push", "layout_id": 3, "version": 1}, {"op": "push", "layout_id": "a", "version": True},
                    {"op": "push", "layout_id": "a", "version": 1, "pause_mode": 5}, {"op": "exec"}):
            reply = client.call(bad)
            assert reply["ok"] is False and reply["error_type"] == "ValueError"
        assert len(handler.calls) == 1
        handler.fail = WeightUpdateError("weights are released")
        assert client.call(push_request("abc", 8, False, None)) == {
            "ok": False, "error_type": "WeightUpdateError", "message": "weights are released"}
        client.close()
    finally:
        server.close()


def test_wrong_token_is_refused_before_any_request():
    handler = _Recorder()
    server = PushChannelServer(handler)
    try:
        with pytest.raises(PushChannelError, match="refused"):
            PushChannelClient(PushChannelInfo(server.host, server.port, "0" * 64))
        # a raw peer that skips the token and sends a request straight away: refused, not run
        with socket.create_connection((server.host, server.port)) as raw:
            send_message(raw, push_request("abc", 1, False, None))
            reply = recv_message(raw)
            assert reply["ok"] is False and reply["error_type"] == "AuthError"
            assert recv_message(raw) is None  # and the connection is closed
        assert handler.calls == []
    finally:
        server.close()


def test_peers_trickling_bytes_without_the_token_hold_no_slot(monkeypatch):
    """The token must arrive within AUTH_TIMEOUT_S in all, not per byte: peers that send a byte
    now and then cannot keep every connection slot from the trainer."""
    import threading
    from weight_sync import push_channel
    monkeypatch.setattr(push_channel, "AUTH_TIMEOUT_S", 0.5)
    server = PushChannelServer(_Recorder())
    stop = threading.Event()

    def trickle(sock):
        try:
            sock.sendall((60000).to_bytes(4, "big"))  # a long message, then its bytes one by one
            while not stop.is_set():
                sock.sendall(b" ")
                time.sleep(0.1)
        except OSError:
            pass  # closed by the server: the point

    peers = [socket.create_connection((server.host, server.port))
             for _ in range(push_channel.MAX_CONNECTIONS)]
    threads = [threading.Thread(target=trickle, args=(p,), daemon=True) for p in peers]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)  # past the deadline, still trickling
        client = PushChannelClient(server.info)
        assert client.call({"op": "ping"}) == {"ok": True}
        client.close()
    finally:
        stop.set()
        for p in peers:
            p.close()
        server.close()


def test_closed_server_is_a_channel_error():
    server = PushChannelServer(_Recorder())
    client = PushChannelClient(server.info)
    server.close()
    with pytest.raises(PushChannelError):
        client.call(push_request("abc", 1, False, None))
    with pytest.raises(PushChannelError):
        PushChannelClient(server.info)


# ---- a TP=1 × DP=2 controller --------------------------------------------------------------------
pytest_ray = pytest.mark.ray


@pytest.fixture(scope="module")
def ctl(tiny_dirs):
    with local_ray(num_cpus=4):  # 2 shards, a rebuilt one, slack
        cfg = EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096, tp_size=1)
        with RolloutController(cfg, num_replicas=2, start_timeout_s=120) as controller:
            yield controller


@pytest.fixture(scope="module")
def oracle(tiny_dirs):
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096))


@pytest.fixture()
def trainer(tiny_dirs, ctl):
    return hf_model(tiny_dirs[ARCH])


def _assert_serves(ctl, oracle, trainer, version: int) -> None:
    oracle.update_weights_from_tensor([(n, p.detach().clone()) for n, p in trainer.named_parameters()])
    want = oracle.runner.export_weights()
    assert ctl.weight_version == version
    for replica in ctl.replicas:
        assert ray.get(replica.leader.status.remote())["weight_version"] == version
        got = ray.get(replica.leader.export_local_weights.remote())
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
        assert (ctl.prefill_logits(PROMPTS, replica.index) - hf_logits(trainer)).abs().max() <= 1e-5


def _wait_alive(ctl, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(r["state"] == "alive" for r in ctl.status()):
        assert time.monotonic() < deadline, ctl.status()
        time.sleep(0.1)


@pytest_ray
def test_pushes_go_over_the_channel_and_land_everywhere(ctl, oracle, trainer):
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    start = ctl.weight_version
    for step in (1, 2, 3):
        perturb(trainer, seed=40 + step)
        assert sender.push(trainer.named_parameters()) == start + step
        assert ctl.last_ipc_path == ("ray" if step == 1 else "channel")  # registered through Ray first
        assert ("channel" in sender.last.extra) == (step > 1)
        _assert_serves(ctl, oracle, trainer, start + step)
    assert sender._ipc.registrations == 1
    assert set(ctl.ipc_push_channels()) == {0, 1}
    assert all(info.host == "127.0.0.1" for info in ctl.ipc_push_channels().values())
    assert ctl.ping_push_channel(0) > 0
    sender.close()


@pytest_ray
def test_wrong_token_changes_nothing(ctl, oracle, trainer):
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    perturb(trainer, seed=50)
    version = sender.push(trainer.named_parameters())
    layout_id = sender._ipc.current.layout.layout_id
    info = ctl.ipc_push_channels()[0]
    with socket.create_connection((info.host, info.port)) as raw:
        send_message(raw, {"token": "f" * 64})
        assert recv_message(raw)["error_type"] == "AuthError"
    with socket.create_connection((info.host, info.port)) as raw:  # a request in place of the token
        send_message(raw, push_request(layout_id, version + 5, False, None))
        assert recv_message(raw)["error_type"] == "AuthError"
    _assert_serves(ctl, oracle, trainer, version)
    sender.close()


@pytest_ray
def test_broken_channel_falls_back_to_ray_then_reconnects(ctl, oracle, trainer):
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    sender.push(trainer.named_parameters())
    ctl._push_clients[1][1]._sock.close()  # the trainer's end of replica 1's channel breaks
    perturb(trainer, seed=60)
    version = sender.push(trainer.named_parameters())
    assert ctl.last_ipc_path == "channel+ray"
    _assert_serves(ctl, oracle, trainer, version)
    perturb(trainer, seed=61)
    version = sender.push(trainer.named_parameters())
    assert ctl.last_ipc_path == "channel"  # reopened
    _assert_serves(ctl, oracle, trainer, version)
    sender.close()


@pytest_ray
def test_unknown_layout_over_the_channel_registers_again_through_ray(ctl, oracle, trainer):
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    sender.push(trainer.named_parameters())
    ray.get(ctl.replicas[0].leader.drop_ipc_layouts.remote(None))  # e.g. evicted
    perturb(trainer, seed=70)
    version = sender.push(trainer.named_parameters())
    assert sender.last.extra.get("reregistered") == 1.0 and ctl.last_ipc_path == "ray"
    _assert_serves(ctl, oracle, trainer, version)
    sender.close()


@pytest_ray
def test_typed_error_over_the_channel_propagates(ctl, oracle, trainer):
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    version = sender.push(trainer.named_parameters())
    ctl.release_memory(("weights",))
    try:
        with pytest.raises(WeightUpdateError, match="released"):
            sender.push(trainer.named_parameters())
        assert ctl.last_ipc_path == "channel" and ctl.weight_version == version
    finally:
        ctl.resume_memory(("weights",))
    perturb(trainer, seed=80)
    version = sender.push(trainer.named_parameters())
    _assert_serves(ctl, oracle, trainer, version)
    sender.close()


@pytest_ray
def test_killed_shard_push_falls_back_and_the_rebuilt_replica_registers_again(ctl, oracle, trainer):
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    sender.push(trainer.named_parameters())
    ray.kill(ctl.replicas[1].leader, no_restart=True)
    time.sleep(0.5)
    perturb(trainer, seed=90)
    version = sender.push(trainer.named_parameters())  # replica 1's channel fails → Ray → recovery
    assert ctl.weight_version == version
    assert ctl.status()[1]["state"] in ("rebuilding", "alive")
    _wait_alive(ctl)  # rebuilt, caught up from replica 0 (version `version`)
    perturb(trainer, seed=91)
    version = sender.push(trainer.named_parameters())  # the new shard lacks the layout
    assert sender.last.extra.get("reregistered") == 1.0
    _assert_serves(ctl, oracle, trainer, version)
    perturb(trainer, seed=92)
    version = sender.push(trainer.named_parameters())
    assert ctl.last_ipc_path == "channel"  # the rebuilt replica's own channel
    _assert_serves(ctl, oracle, trainer, version)
    sender.close()
