"""Spec for weight sync into a RolloutController with TP=2 shards (CPU, local Ray): every
transport lands the trainer's weights in every rank's slices (logits equal HF's), bad updates
change nothing, in-flight requests survive every pause mode, and a trainer dying mid-broadcast
leaves the replicas refusing to generate until a complete update lands."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from actors import RolloutController
from rollout import EngineConfig, EngineNotReadyError, SamplingParams, WeightUpdateError
from tests.helpers import hf_model
from tests.ray_helpers import local_ray
from tests.test_weight_sync import BAD_UPDATES, PROMPTS, _dying_trainer, hf_logits, perturb
from weight_sync import TRANSPORTS, WeightSender
from weight_sync.bucket import UpdateManifest, plan_buckets
from weight_sync.process_group import GroupAddress, free_port
from weight_sync.spec import specs_of

pytestmark = pytest.mark.ray
ARCH = "LlamaForCausalLM"


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2xdp1", "tp1xdp2"])
def ctl(tiny_dirs, request):
    tp_size, num_replicas = request.param
    with local_ray(num_cpus=4):
        cfg = EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096, tp_size=tp_size)
        with RolloutController(cfg, num_replicas=num_replicas) as controller:
            yield controller


@pytest.fixture()
def trainer(tiny_dirs, ctl):
    """An HF model in the state the controller serves (resynced after each test)."""
    model = hf_model(tiny_dirs[ARCH])
    yield model
    fresh = hf_model(tiny_dirs[ARCH])
    ctl.update_weights_from_tensor(list(fresh.named_parameters()))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_into_tp2_replica(ctl, trainer, transport):
    sender = WeightSender(ctl, transport, bucket_bytes=64 << 10)
    start = ctl.weight_version
    perturb(trainer, seed=21)
    assert sender.push(trainer.named_parameters()) == start + 1 == ctl.weight_version
    for replica in range(ctl.num_replicas):
        assert (ctl.prefill_logits(PROMPTS, replica) - hf_logits(trainer)).abs().max() <= 1e-5
    out = ctl.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))[0]
    assert out.token_weight_versions == [start + 1] * 2
    sender.close()


def test_ipc_layout_registered_once_and_again_for_a_shard_that_lost_it(ctl, trainer):
    """Registered IPC through Ray: the layout goes to every shard once, then only its id; a
    shard without it (as a rebuilt replica) makes the sender register again, transparently."""
    import ray
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    for seed in (41, 42):
        perturb(trainer, seed=seed)
        sender.push(trainer.named_parameters())
    assert sender._ipc.registrations == 1 and "register" not in sender.last.extra
    ray.get([s.drop_ipc_layouts.remote() for s in ctl.replicas[-1].shards])
    perturb(trainer, seed=43)
    assert sender.push(trainer.named_parameters()) == ctl.weight_version
    assert sender.last.extra.get("reregistered") == 1.0 and sender._ipc.registrations == 1
    for replica in range(ctl.num_replicas):
        assert (ctl.prefill_logits(PROMPTS, replica) - hf_logits(trainer)).abs().max() <= 1e-5
    assert ctl.weight_sync_free_bytes() is None  # CPU shards: the default bucket size
    sender.close()  # every shard unmaps the trainer's memory
    shards = [s for r in ctl.replicas for s in r.shards]
    assert ray.get([s.__ray_call__.remote(lambda self: self.updater.ipc_layouts.ids())
                    for s in shards]) == [[]] * len(shards)


def test_ranks_that_loaded_while_another_failed_make_the_replica_refuse(ctl, trainer):
    """One rank of a TP replica fails before writing while the other loads: a mix of two
    versions, so the replica refuses to generate until a complete update lands."""
    import ray
    replica = ctl.replicas[0]
    if replica.tp_size == 1:
        pytest.skip("needs a TP replica")
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    sender.push(trainer.named_parameters())
    ray.get(replica.shards[1].drop_ipc_layouts.remote())
    perturb(trainer, seed=44)
    sender._ipc.prepare([(n, p.detach()) for n, p in trainer.named_parameters()], False)
    ray.get(replica.leader.pause.remote(None))  # as the controller does, minus its precheck
    try:
        errors, _ = ctl._apply_everywhere("ipc", sender._ipc.current.layout.ref, False, [replica])
    finally:
        ray.get(replica.leader.resume.remote())
    assert errors and "not registered here" in str(errors[0])
    with pytest.raises(EngineNotReadyError, match="the other ranks loaded"):
        ctl.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    sender.push(trainer.named_parameters())  # registers again on rank 1; complete again
    assert (ctl.prefill_logits(PROMPTS) - hf_logits(trainer)).abs().max() <= 1e-5
    sender.close()


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_bad_update_leaves_tp2_replica_untouched(ctl, trainer, case):
    before, version = ctl.prefill_logits(PROMPTS), ctl.weight_version
    perturb(trainer, seed=4)
    make_bad, message = BAD_UPDATES[case]
    with pytest.raises(WeightUpdateError, match=message):
        ctl.update_weights_from_tensor(make_bad([(n, p.detach().clone()) for n, p in trainer.named_parameters()]))
    assert torch.equal(ctl.prefill_logits(PROMPTS), before) and ctl.weight_version == version


def test_partial_update(ctl, trainer):
    perturb(trainer, seed=8)
    subset = [(n, p.detach().clone()) for n, p in trainer.named_parameters() if "mlp" in n]
    with pytest.raises(WeightUpdateError, match="missing"):
        ctl.update_weights_from_tensor(subset)
    ctl.update_weights_from_tensor(subset, allow_partial=True)
    perturb(trainer, seed=8, scale=-0.02)
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if "mlp" in n:
                p.copy_(dict(subset)[n])
    assert (ctl.prefill_logits(PROMPTS) - hf_logits(trainer)).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_update_while_64_requests_generate(ctl, trainer, mode):
    prompts = [[i % 250 + 1, (7 * i) % 250 + 1, 3] for i in range(64)]
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    start = ctl.weight_version
    steps = _leader_steps(ctl)
    fut = ctl.generate_async(prompts, sp)
    while _leader_steps(ctl) < steps + 3:  # the update lands mid-generation
        time.sleep(0.01)
    perturb(trainer, seed=31)
    assert ctl.update_weights_from_tensor(list(trainer.named_parameters()), pause_mode=mode) == start + 1
    outs = fut.result(timeout=120)
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, 0) for i in range(64)]
    for o in outs:
        assert len(o.token_weight_versions) == len(o.token_ids) > 0
        assert o.token_weight_versions == sorted(o.token_weight_versions)
        assert set(o.token_weight_versions) <= {start, start + 1}
    if mode == "abort":
        assert any(o.finish_reason == "abort" for o in outs)
        assert all(set(o.token_weight_versions) == {start} for o in outs if o.finish_reason == "abort")
    else:
        assert all(len(o.token_ids) == 32 for o in outs)
        assert any(set(o.token_weight_versions) == {start, start + 1} for o in outs)


def _leader_steps(ctl) -> int:
    return sum(r["shards"][0]["stats"]["steps"] for r in ctl.status())


def test_trainer_killed_mid_broadcast(ctl, trainer, tiny_dirs):
    bucket_bytes = 64 << 10
    addr = GroupAddress("127.0.0.1", free_port(), 1 + ctl.num_weight_sync_ranks, "gloo", timeout_s=60)
    proc = mp.get_context("spawn").Process(target=_dying_trainer,
                                           args=(addr, tiny_dirs[ARCH], bucket_bytes))
    proc.start()
    ctl.init_weights_update_group(addr, 1)
    manifest = UpdateManifest(plan_buckets(specs_of(trainer.named_parameters()), bucket_bytes))
    with pytest.raises(WeightUpdateError, match="stopped at bucket 2/"):
        ctl.update_weights_from_distributed(manifest)
    proc.join(timeout=30)
    with pytest.raises(EngineNotReadyError, match="incomplete"):
        ctl.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    ctl.destroy_weights_update_group()
    perturb(trainer, seed=3)
    version = ctl.update_weights_from_tensor(list(trainer.named_parameters()))
    assert (ctl.prefill_logits(PROMPTS) - hf_logits(trainer)).abs().max() <= 1e-5
    assert ctl.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_weight_versions == [version] * 2


def test_an_update_some_replicas_fail_leaves_every_serving_replica_on_one_version(ctl, trainer):
    """A push that one replica cannot take (it lost the registered layout, as a rebuilt one)
    fails before any replica loads it — over the push channels and through Ray alike. One that
    a replica fails while loading (after the checks) leaves the controller on its version: the
    replica that took it goes stale until a complete update lands, so every sample comes from
    the old weights of the replica that serves."""
    import ray
    from weight_sync.ipc_layout import IpcLayoutUnknownError
    if ctl.replicas[0].tp_size != 1:
        pytest.skip("needs two single-rank replicas")
    sender = WeightSender(ctl, "ipc", bucket_bytes=64 << 10)
    sender.push(trainer.named_parameters())
    version, before = ctl.weight_version, [ctl.prefill_logits(PROMPTS, i) for i in range(2)]
    ref = sender._ipc.current.layout.ref
    perturb(trainer, seed=45)
    sender._ipc.prepare([(n, p.detach()) for n, p in trainer.named_parameters()], False)

    ray.get(ctl.replicas[1].leader.drop_ipc_layouts.remote())
    for channels in (True, False):
        ctl.use_push_channels = channels
        with pytest.raises(IpcLayoutUnknownError, match="not registered here"):
            ctl.update_weights_from_ipc(ref)
        assert ctl.weight_version == version and [r["state"] for r in ctl.status()] == ["alive"] * 2
        assert all(torch.equal(ctl.prefill_logits(PROMPTS, i), before[i]) for i in range(2))
    ctl.use_push_channels = True
    assert sender.push(trainer.named_parameters()) == version + 1  # registers again on replica 1
    version, before = ctl.weight_version, [ctl.prefill_logits(PROMPTS, i) for i in range(2)]

    def fail_next_ipc_load(shard) -> None:  # (in the shard actor) before writing anything
        updater, real = shard.updater, shard.updater.from_ipc

        def once(*args, **kwargs):
            updater.from_ipc = real
            raise WeightUpdateError("injected: this replica's load failed before writing")
        updater.from_ipc = once

    ray.get(ctl.replicas[1].leader.__ray_call__.remote(fail_next_ipc_load))
    perturb(trainer, seed=46)
    with pytest.raises(WeightUpdateError, match="injected"):
        sender.push(trainer.named_parameters())
    assert ctl.last_ipc_path == "channel" and ctl.weight_version == version
    states = {r["index"]: r for r in ctl.status()}
    assert states[0]["state"] == "stale" and "failed on replica(s) [1]" in states[0]["last_failure"]
    assert states[1]["state"] == "alive"
    outs = ctl.generate([[1, 2, 3]] * 8, SamplingParams(max_new_tokens=2))
    assert all(o.token_weight_versions == [version] * 2 for o in outs)  # replica 1 only
    assert torch.equal(ctl.prefill_logits(PROMPTS, 1), before[1])

    assert sender.push(trainer.named_parameters()) == version + 1 == ctl.weight_version
    assert [r["state"] for r in ctl.status()] == ["alive"] * 2
    for replica in range(2):
        assert (ctl.prefill_logits(PROMPTS, replica) - hf_logits(trainer)).abs().max() <= 1e-5
    sender.close()


def test_explicit_versions_are_checked_before_anything_moves(ctl, trainer):
    version = ctl.weight_version
    for bad in ("7", True, -1, 2.0):
        with pytest.raises(WeightUpdateError, match="version must be a non-negative int"):
            ctl.update_weights_from_tensor(list(trainer.named_parameters()), version=bad)
    assert ctl.weight_version == version
