"""Spec for replica failure (CPU, local Ray): a shard of one replica — its leader or a follower —
is killed while a RolloutController.generate of 200 requests runs over two TP=2 replicas. The
call still returns all 200 samples, the same ones healthy replicas give (the dead replica's
prompts re-run on the healthy one, with the seeds already drawn, and say so); the replica is
rebuilt, brought to the latest weights before it takes work, and serves again. With no healthy
replica to copy from, a rebuilt replica serves only if no update ever landed; else it is stale
and refuses until the next full update."""
from __future__ import annotations

import time

import pytest
import ray
import torch

from actors import RolloutController
from rollout import EngineConfig, EngineNotReadyError, SamplingParams
from tests.helpers import hf_model
from tests.ray_helpers import local_ray
from tests.test_weight_sync import hf_logits, perturb

pytestmark = pytest.mark.ray
ARCH = "LlamaForCausalLM"
N = 200
PROMPTS = [[(7 * i) % 250 + 1, (13 * i) % 250 + 1, 3, 4] for i in range(N)]
PARAMS = [SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True, seed=1000 + i) for i in range(N)]


@pytest.fixture(scope="module")
def ray_session():
    with local_ray(num_cpus=7):  # 4 shards, a rebuilt replica's 2 before the old group is gone, 1 TP=1
        yield


@pytest.fixture(scope="module")
def ctl(ray_session, tiny_dirs):
    # the prefix cache off: its routing would send the prompts each test gives again to where
    # they ran before, and the specs count on equal costs alternating between the two replicas
    cfg = EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096, tp_size=2, max_running_requests=16,
                       prefix_cache=False)
    with RolloutController(cfg, num_replicas=2, dist_timeout_s=15, start_timeout_s=120) as controller:
        yield controller


@pytest.fixture(scope="module")
def trainer(ctl, tiny_dirs):
    """Version 1 is pushed first, so a rebuilt replica's checkpoint is stale: it must copy."""
    model = hf_model(tiny_dirs[ARCH])
    perturb(model, seed=5)
    assert ctl.update_weights_from_tensor(list(model.named_parameters())) == 1
    return model


@pytest.fixture(scope="module")
def reference(ctl, trainer):
    return ctl.generate(PROMPTS, PARAMS)


def _steps(ctl, index: int) -> int:
    return ctl.status()[index]["shards"][0]["stats"]["steps"]


def _wait_until(cond, timeout_s: float = 120.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _wait_for_state(ctl, index: int, state: str) -> dict:
    return _wait_until(lambda: next((r for r in ctl.status() if r["index"] == index and r["state"] == state),
                                    None), what=f"replica {index} {state}")


@pytest.mark.parametrize("rank", [0, 1], ids=["leader", "follower"])
def test_kill_a_shard_mid_generate(ctl, trainer, reference, rank):
    victim = 1
    restarts = ctl.status()[victim]["restarts"]
    steps = _steps(ctl, victim)
    fut = ctl.generate_async(PROMPTS, PARAMS)
    _wait_until(lambda: _steps(ctl, victim) >= steps + 5, what="the victim to be mid-generation")
    ray.kill(ctl.replicas[victim].shards[rank])
    outs = fut.result(timeout=180)

    # every sample is back, in order, and equal to what healthy replicas gave
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, 0) for i in range(N)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    for o, r in zip(outs, reference):
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    assert all(o.weight_version == 1 and len(o.token_ids) == 24 for o in outs)
    rerun = [o for o in outs if o.rerun_after_failure]
    assert len(rerun) == N // 2  # the victim's half (equal costs alternate), re-run on replica 0

    # health is visible; the replica comes back at the latest weights, then takes work again
    assert ctl.status()[victim]["state"] in ("rebuilding", "alive")
    record = _wait_for_state(ctl, victim, "alive")
    assert record["alive"] and record["restarts"] == restarts + 1 and record["last_failure"]
    assert record["shards"][0]["weight_version"] == 1
    head = PROMPTS[:3]
    assert torch.equal(ctl.prefill_logits(head, replica=victim), ctl.prefill_logits(head, replica=0))
    assert (ctl.prefill_logits(head, replica=victim) - hf_logits(trainer, head)).abs().max() <= 1e-5
    before = _steps(ctl, victim)
    again = ctl.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
    assert not any(o.rerun_after_failure for o in again)
    assert _steps(ctl, victim) > before


def test_without_a_healthy_replica_a_rebuild_is_stale_until_an_update(ray_session, tiny_dirs):
    cfg = EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=2048)
    prompts, params = PROMPTS[:8], PARAMS[:8]
    with RolloutController(cfg, num_replicas=1, dist_timeout_s=15, start_timeout_s=120) as ctl:
        reference = ctl.generate(prompts, params)

        # no update yet: the checkpoint is the latest weights, the rebuilt replica takes the re-run
        ray.kill(ctl.replicas[0].leader)
        outs = ctl.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
        assert all(o.rerun_after_failure for o in outs)
        assert ctl.status()[0]["state"] == "alive" and ctl.status()[0]["restarts"] == 1

        # after an update, a replica rebuilt from the checkpoint would be stale: it refuses
        trainer = hf_model(tiny_dirs[ARCH])
        perturb(trainer, seed=7)
        assert ctl.update_weights_from_tensor(list(trainer.named_parameters())) == 1
        ray.kill(ctl.replicas[0].leader)
        with pytest.raises(EngineNotReadyError, match="full weight update"):
            ctl.generate(prompts, params)
        record = ctl.status()[0]
        assert record["state"] == "stale" and not record["alive"] and record["restarts"] == 2

        perturb(trainer, seed=8)
        assert ctl.update_weights_from_tensor(list(trainer.named_parameters())) == 2
        assert ctl.status()[0]["state"] == "alive"
        assert (ctl.prefill_logits(prompts[:3]) - hf_logits(trainer, prompts[:3])).abs().max() <= 1e-5
        assert {o.weight_version for o in ctl.generate(prompts, params)} == {2}
