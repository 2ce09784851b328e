"""GPU spec for registered CUDA IPC pushes (skipped without a GPU; `bash benchmarks/gpu_suite.sh
wsync-test`). A bf16 trainer on the replica's GPU registers its own tensors once (no packing
copy); after every push the replica's weights equal, bit for bit, those that the ordinary
per-tensor load path gives for the same tensors, and so do its logits. Trainers that hand new
tensors every push (`p.to(bfloat16)` copies) switch to staging buckets after one
re-registration. An Engine in the trainer's own process reads the trainer's tensors directly."""
from __future__ import annotations

import pytest
import ray
import torch

from rollout import Engine, EngineConfig, SamplingParams
from tests.helpers import hf_model
from tests.ray_helpers import local_ray
from tests.test_weight_sync import PROMPTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ARCH = "Qwen2ForCausalLM"


def _cfg(path: str) -> EngineConfig:
    return EngineConfig(model_path=path, device="cuda", dtype="bfloat16", kv_cache_tokens=4096)


def _replica_device(ctl) -> torch.device:
    """This process's index of the GPU that Ray gave replica 0 (the trainer must share it)."""
    import os
    phys = ray.get(ctl.replicas[0].leader.__ray_call__.remote(lambda self: ray.get_gpu_ids()))[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    local = [int(x) for x in visible.split(",")] if visible else list(range(torch.cuda.device_count()))
    return torch.device("cuda", local.index(int(phys)))


def _replica_weights(ctl) -> dict[str, torch.Tensor]:
    return ray.get(ctl.replicas[0].leader.export_local_weights.remote())


def _check_equals_fresh_load(ctl, named) -> None:
    """The replica now holds what the ordinary load path gives for `named` (and the same logits)."""
    got, logits = _replica_weights(ctl), ctl.prefill_logits(PROMPTS)
    ctl.update_weights_from_tensor([(n, t.detach().cpu()) for n, t in named])
    want = _replica_weights(ctl)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
    assert torch.equal(logits, ctl.prefill_logits(PROMPTS))


@pytest.fixture(scope="module")
def ctl(tiny_dirs):
    from actors import RolloutController
    with local_ray(num_cpus=4):
        with RolloutController(_cfg(tiny_dirs[ARCH]), num_replicas=1) as controller:
            yield controller


def _perturb_in_place(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.02).to(p.device, p.dtype))


def test_direct_registration_once_into_a_replica(ctl, tiny_dirs):
    from weight_sync import WeightSender
    trainer = hf_model(tiny_dirs[ARCH]).to(_replica_device(ctl), torch.bfloat16)
    sender = WeightSender(ctl, "ipc")
    for step in (1, 2, 3):
        _perturb_in_place(trainer, seed=step)  # the registered tensors, new values
        named = list(trainer.named_parameters())
        assert sender.push(named) == ctl.weight_version
        _check_equals_fresh_load(ctl, named)
    assert not sender._ipc.current.staged and sender._ipc.current.layout.tensors
    assert sender._ipc.registrations == 1
    sender.close()


def test_direct_registration_survives_in_place_optimizer_steps(ctl, tiny_dirs):
    from weight_sync import WeightSender
    device = _replica_device(ctl)
    trainer = hf_model(tiny_dirs[ARCH]).to(device, torch.bfloat16)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.1)
    sender = WeightSender(ctl, "ipc")
    for step in range(3):
        loss = trainer(torch.tensor([PROMPTS[0]], device=device)).logits.float().square().mean()
        loss.backward()
        opt.step()  # in place: same storages, new values
        opt.zero_grad()
        sender.push(trainer.named_parameters())
        _check_equals_fresh_load(ctl, list(trainer.named_parameters()))
    assert sender._ipc.registrations == 1 and "register" not in sender.last.extra
    sender.close()


def test_new_tensors_every_push_switch_to_staging(ctl, tiny_dirs):
    from weight_sync import WeightSender
    trainer = hf_model(tiny_dirs[ARCH]).to(_replica_device(ctl))  # fp32 master weights
    sender = WeightSender(ctl, "ipc")
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.01 * step)
        named = [(n, p.detach().to(torch.bfloat16)) for n, p in trainer.named_parameters()]
        sender.push(named)
        _check_equals_fresh_load(ctl, named)
    assert sender._ipc.current.staged and sender._ipc.registrations == 2  # direct, then staged
    sender.close()


@pytest.mark.parametrize("direct_mb", ["0", "-1"], ids=["memcpy-per-tensor", "foreach-only"])
def test_in_process_engine_reads_the_trainers_tensors(tiny_dirs, monkeypatch, direct_mb):
    from weight_sync import WeightSender
    monkeypatch.setenv("WEIGHT_SYNC_DIRECT_COPY_MB", direct_mb)
    engine, oracle = Engine(_cfg(tiny_dirs[ARCH])), Engine(_cfg(tiny_dirs[ARCH]))
    trainer = hf_model(tiny_dirs[ARCH]).to(engine.runner.device, torch.bfloat16)
    sender = WeightSender(engine, "ipc")
    for step in (1, 2):
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(1.0 + 0.01 * step)
        sender.push(trainer.named_parameters())
        oracle.update_weights_from_tensor([(n, p.detach().clone()) for n, p in trainer.named_parameters()])
        for (n, a), (_, b) in zip(engine.runner.model.named_parameters(), oracle.runner.model.named_parameters()):
            assert torch.equal(a, b), n
        assert torch.equal(engine.prefill_logits(PROMPTS), oracle.prefill_logits(PROMPTS))
    plan = engine.updater.ipc_layouts._layouts[engine.updater.ipc_layouts.ids()[0]].plan
    assert (len(plan.direct) == plan.num_copies) if direct_mb == "0" else not plan.direct
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)  # decode graphs replay the new weights
    assert engine.generate([PROMPTS[0]], sp)[0].token_ids == oracle.generate([PROMPTS[0]], sp)[0].token_ids
    sender.close()
