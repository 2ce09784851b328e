"""Spec for weight sync into an Engine (TP=1): every transport lands the trainer's new weights
exactly (logits equal HF's on the same inputs), bad updates change nothing, in-flight requests
survive every pause mode, and a trainer dying mid-broadcast leaves the engine refusing to
generate until a complete update lands."""
import multiprocessing as mp
import threading
import time

import pytest
import torch

from rollout import Engine, EngineConfig, EngineNotReadyError, SamplingParams, WeightUpdateError
from weight_sync import TRANSPORTS, WeightSender
from weight_sync.bucket import UpdateManifest, pack, plan_buckets
from weight_sync.process_group import GroupAddress, WeightSyncGroup, free_port
from weight_sync.spec import specs_of
from tests.helpers import hf_model

PROMPTS = [[1, 2, 3, 4, 5], [300, 20, 7], [9] * 11]


def perturb(model, seed: int, scale: float = 0.02) -> None:
    """A seeded change to every weight (stands in for optimizer steps)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def engine_logits(engine, prompts=PROMPTS) -> torch.Tensor:
    """Last-token logits of a fresh prefill (an Engine or a RolloutController)."""
    return engine.prefill_logits(prompts)


@torch.no_grad()
def hf_logits(model, prompts=PROMPTS) -> torch.Tensor:
    return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])


@pytest.fixture()
def setup(tiny_dirs):
    path = tiny_dirs["Qwen2ForCausalLM"]
    return Engine(EngineConfig(model_path=path, kv_cache_tokens=4096)), hf_model(path)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_lands_trainer_weights(setup, transport):
    engine, trainer = setup
    sender = WeightSender(engine, transport, bucket_bytes=64 << 10, checksum=transport != "nccl")
    for step in (1, 2):
        perturb(trainer, seed=step)
        version = sender.push(trainer.named_parameters())
        assert version == engine.weight_version == step
        assert (engine_logits(engine) - hf_logits(trainer)).abs().max() <= 1e-5
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3))[0]
    assert out.weight_version == 2 and out.token_weight_versions == [2, 2, 2]
    sender.close()


def test_partial_update_only_when_asked(setup):
    engine, trainer = setup
    perturb(trainer, seed=5)
    subset = [(n, p.detach().clone()) for n, p in trainer.named_parameters() if ".layers.1." in n]
    with pytest.raises(WeightUpdateError, match="missing"):
        engine.update_weights_from_tensor(subset)
    assert engine.weight_version == 0
    assert engine.update_weights_from_tensor(subset, allow_partial=True) == 1
    perturb(trainer, seed=5, scale=-0.02)  # undo the change everywhere but layer 1 ...
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if ".layers.1." in n:
                p.copy_(dict(subset)[n])  # ... which keeps the pushed values
    assert (engine_logits(engine) - hf_logits(trainer)).abs().max() <= 1e-5


def test_named_tensors_load_without_staging_buckets(setup, monkeypatch):
    """An Engine given (name, tensor) pairs loads them from where they are: no bucket is packed
    (on a GPU, device tensors went device → host → device through buckets: 31 GB took 31 s)."""
    import weight_sync.bucket as bucket

    def no_packing(*args, **kwargs):
        raise AssertionError("named tensors were packed into a bucket")
    monkeypatch.setattr(bucket, "pack", no_packing)
    engine, trainer = setup
    perturb(trainer, seed=4)
    assert engine.update_weights_from_tensor(trainer.named_parameters()) == 1
    assert (engine_logits(engine) - hf_logits(trainer)).abs().max() <= 1e-5
    with pytest.raises(WeightUpdateError, match="pairs"):
        engine.update_weights_from_tensor([("model.norm.weight", [1.0])])
    assert engine.weight_version == 1


BAD_UPDATES = {
    "unknown name": (lambda w: w + [("model.layers.7.mlp.up_proj.weight", torch.zeros(3))],
                     "unknown tensor 'model.layers.7.mlp.up_proj.weight'"),
    "wrong shape": (lambda w: [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in w],
                    "'model.norm.weight' has shape"),
    "wrong dtype": (lambda w: [(n, t.double() if n == "lm_head.weight" else t) for n, t in w],
                    "'lm_head.weight' has dtype torch.float64"),
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
@pytest.mark.parametrize("transport", ["tensor", "nccl", "ipc"])
def test_bad_update_changes_nothing(setup, case, transport):
    engine, trainer = setup
    before = engine_logits(engine).clone()
    perturb(trainer, seed=9)
    make_bad, message = BAD_UPDATES[case]
    weights = make_bad([(n, p.detach().clone()) for n, p in trainer.named_parameters()])
    sender = WeightSender(engine, transport)
    with pytest.raises(WeightUpdateError, match=message):
        sender.push(weights)
    assert torch.equal(engine_logits(engine), before)
    assert engine.weight_version == 0 and engine.updater.incomplete_reason is None
    sender.close()


def _greedy_oracle_ok(out, models) -> bool:
    """Each token is the argmax of the weights version that produced it, on the full prefix."""
    seq = list(out.prompt_token_ids)
    for tok, version in zip(out.token_ids, out.token_weight_versions):
        if hf_logits(models[version], [seq])[0].argmax().item() != tok:
            return False
        seq.append(tok)
    return True


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_update_during_generation(tiny_dirs, mode):
    path = tiny_dirs["Qwen2ForCausalLM"]
    engine = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096, pause_mode=mode))
    old, new = hf_model(path), hf_model(path)
    perturb(new, seed=11, scale=0.05)
    prompts = [[i % 250 + 1, (7 * i) % 250 + 1, 3] for i in range(64)]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    worker = threading.Thread(target=lambda: results.update(outs=engine.generate(prompts, sp)))
    worker.start()
    while engine.stats.steps < 4:
        time.sleep(0.001)
    assert engine.update_weights_from_tensor(list(new.named_parameters())) == 1
    worker.join(timeout=120)
    outs = results["outs"]
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, 0) for i in range(64)]
    for o in outs:
        assert len(o.token_weight_versions) == len(o.token_ids)
        assert o.token_weight_versions == sorted(o.token_weight_versions)
    if mode == "abort":
        aborted = [o for o in outs if o.finish_reason == "abort"]
        assert aborted and all(0 < len(o.token_ids) < 24 and set(o.token_weight_versions) == {0} for o in aborted)
    else:
        assert all(len(o.token_ids) == 24 for o in outs)
        assert any(set(o.token_weight_versions) == {0, 1} for o in outs)
    if mode == "retract":  # KV recomputed: every token is the right model's greedy choice
        assert all(_greedy_oracle_ok(o, {0: old, 1: new}) for o in outs[:8])


def _dying_trainer(addr: GroupAddress, path: str, bucket_bytes: int):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    group = WeightSyncGroup(addr, 0)
    metas = plan_buckets(specs_of(named), bucket_bytes)
    group.broadcast(pack(metas[0], dict(named)).flat, src=0)
    import os
    os._exit(1)  # dies before the second bucket


def test_trainer_killed_mid_broadcast(setup, tiny_dirs):
    engine, trainer = setup
    path, bucket_bytes = tiny_dirs["Qwen2ForCausalLM"], 64 << 10
    addr = GroupAddress("127.0.0.1", free_port(), 2, "gloo", timeout_s=60)
    proc = mp.get_context("spawn").Process(target=_dying_trainer, args=(addr, path, bucket_bytes))
    proc.start()
    engine.init_weights_update_group(addr, 1)
    manifest = UpdateManifest(plan_buckets(specs_of(trainer.named_parameters()), bucket_bytes))
    assert len(manifest.buckets) > 2
    with pytest.raises(WeightUpdateError, match="stopped at bucket 2/"):
        engine.update_weights_from_distributed(manifest)
    proc.join(timeout=30)
    with pytest.raises(EngineNotReadyError, match="incomplete"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.destroy_weights_update_group()
    perturb(trainer, seed=3)
    assert engine.update_weights_from_tensor(list(trainer.named_parameters())) == 1
    assert (engine_logits(engine) - hf_logits(trainer)).abs().max() <= 1e-5
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_weight_versions == [1, 1]


def test_push_passes_pause_mode(setup):
    engine, trainer = setup
    sender = WeightSender(engine, "tensor")
    from rollout import ConfigError
    with pytest.raises(WeightUpdateError, match="pause_mode"):  # the sender's check, any transport
        sender.push(trainer.named_parameters(), pause_mode="later")
    with pytest.raises(ConfigError, match="pause_mode"):  # the engine's own
        engine.update_weights_from_tensor(list(trainer.named_parameters()), pause_mode="later")
    assert engine.weight_version == 0
    assert sender.push(trainer.named_parameters(), pause_mode="abort") == 1


def test_a_failed_checkpoint_write_leaves_no_temporary_directory(tmp_path, monkeypatch):
    """The disk sender writes a sibling and renames it into place; a write that fails (a full
    disk) removes the sibling, and the checkpoint already there stays as it was."""
    from weight_sync import disk
    weights = [("a", torch.ones(4)), ("b", torch.zeros(2))]
    out = disk.save_atomic(weights, tmp_path / "ckpt")
    before = (out / "model.safetensors").read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        disk.save_atomic([("a", torch.full((4,), 2.0))], tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (out / "model.safetensors").read_bytes() == before


def test_a_broadcast_the_receiver_refused_leaves_the_next_push_working(tiny_dirs):
    """The receiver rejects a bucket mid-broadcast (NaN with check_finite): the push fails typed
    and the engine refuses until a full update; the sender and the engine leave the group they
    can no longer trust, so the next push (a new group) lands."""
    path = tiny_dirs["Qwen2ForCausalLM"]
    engine = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096, check_finite=True))
    trainer = hf_model(path)
    sender = WeightSender(engine, "nccl", bucket_bytes=64 << 10, group_timeout_s=5)
    with pytest.raises(WeightUpdateError, match="pause_mode must be one of"):
        sender.push(trainer.named_parameters(), pause_mode="later")  # before any byte moves
    with pytest.raises(WeightUpdateError, match="version must be a non-negative int"):
        sender.push(trainer.named_parameters(), version=2.0)
    assert sender.group is None and engine.updater.incomplete_reason is None
    perturb(trainer, seed=12)
    named = [(n, p.detach().clone()) for n, p in trainer.named_parameters()]
    named[-1][1][0] = float("nan")
    with pytest.raises(WeightUpdateError, match="NaN"):
        sender.push(named)
    assert sender.group is None and engine.updater.group is None
    with pytest.raises(EngineNotReadyError, match="incomplete"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert sender.push(trainer.named_parameters()) == 1
    assert (engine_logits(engine) - hf_logits(trainer)).abs().max() <= 1e-5
    assert sender.push([], allow_partial=True) == 2  # nothing to send: a version bump
    sender.close()
