"""Spec: the controller's failure paths end, and clean up (CPU, local Ray). A replica rebuild
that fails after its new actors and placement group exist removes them (the replica is `dead`,
the call that found the failure still returns every sample); a TP follower whose loop failed
exits, so its replica is rebuilt instead of its leader blocking; generate calls piling up during
a TP weight update do not take the threads the update's own calls need."""
from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from actors import RolloutController
from rollout import EngineConfig, SamplingParams
from tests.ray_helpers import local_ray

pytestmark = pytest.mark.ray
ARCH = "LlamaForCausalLM"


def _live_groups() -> int:
    return sum(1 for g in placement_group_table().values() if g["state"] != "REMOVED")


def test_a_rebuild_that_fails_leaves_no_placement_group(tiny_dirs):
    with local_ray(num_cpus=4):
        cfg = EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=1024)
        with RolloutController(cfg, num_replicas=2, start_timeout_s=120) as ctl:
            assert _live_groups() == 2

            def failing_catch_up(new):
                raise RuntimeError("injected: the copy source died")

            ctl._catch_up = failing_catch_up
            ray.kill(ctl.replicas[1].leader, no_restart=True)
            prompts = [[i + 1, 2, 3] for i in range(8)]
            outs = ctl.generate(prompts, SamplingParams(max_new_tokens=3, seed=1, ignore_eos=True))
            assert sorted(o.prompt_index for o in outs) == list(range(8))
            deadline = time.monotonic() + 120
            while ctl.status()[1]["state"] != "dead":
                assert time.monotonic() < deadline, "the rebuild never ended"
                time.sleep(0.1)
            assert "injected" in ctl.status()[1]["last_failure"]
            assert _live_groups() == 1  # replica 0's; the failed rebuild's is gone
        assert _live_groups() == 0


def test_a_follower_whose_loop_failed_exits_so_the_replica_is_rebuilt_not_hung(tiny_dirs):
    """The leader's forward fails after the step went out to its follower (an out-of-memory,
    say): the follower waits out its collective and its loop stops. It exits then, so the
    leader's next step fails at once instead of blocking on a peer that no longer receives, and
    the controller rebuilds the replica and re-runs the prompts."""
    with local_ray(num_cpus=4):
        cfg = EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=1024, tp_size=2)
        with RolloutController(cfg, num_replicas=1, dist_timeout_s=3, start_timeout_s=120) as ctl:
            sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
            reference = ctl.generate([[1, 2, 3], [4, 5]], sp)

            def fail_next_forward(shard):
                runner, real = shard.engine.runner, shard.engine.runner.forward

                def once(fb):
                    runner.forward = real
                    raise RuntimeError("injected: out of memory in the leader's forward")
                runner.forward = once

            ray.get(ctl.replicas[0].leader.__ray_call__.remote(fail_next_forward))
            with pytest.raises(RuntimeError, match="injected"):
                ctl.generate([[1, 2, 3]], sp)
            deadline = time.monotonic() + 60
            while ctl.status()[0]["alive"]:  # the follower's loop stops, its process exits
                assert time.monotonic() < deadline, "the follower's loop never ended"
                time.sleep(0.2)
            outs = ctl.generate_async([[1, 2, 3], [4, 5]], sp).result(timeout=90)  # not a hang
            assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
            assert all(o.rerun_after_failure for o in outs) and ctl.status()[0]["restarts"] == 1


def test_many_generate_calls_during_a_tp_update_do_not_starve_it(tiny_dirs):
    """A TP update is several Ray calls to the leader (pause, load, commit, resume). Generate
    calls that arrive while a follower loads wait at the paused engine — in threads of their
    own, so the update's calls still run: the update lands, then every call."""
    import threading
    from tests.helpers import hf_model
    from tests.test_weight_sync import perturb
    with local_ray(num_cpus=4):
        cfg = EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=1024, tp_size=2)
        with RolloutController(cfg, num_replicas=1, start_timeout_s=120) as ctl:
            sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
            ctl.generate([[1, 2, 3]], sp)

            def slow_follower_load(shard):
                real = shard.updater.from_buckets

                def slow(*args, **kwargs):
                    time.sleep(3)
                    return real(*args, **kwargs)
                shard.updater.from_buckets = slow

            ray.get(ctl.replicas[0].shards[1].__ray_call__.remote(slow_follower_load))
            new = hf_model(tiny_dirs[ARCH])
            perturb(new, seed=3)
            result = {}
            update = threading.Thread(target=lambda: result.update(
                version=ctl.update_weights_from_tensor(list(new.named_parameters()))))
            update.start()
            time.sleep(1.0)  # paused, the follower loading
            calls = [ctl.generate_async([[1, 2, 3]], sp) for _ in range(6)]
            update.join(timeout=60)
            assert not update.is_alive() and result["version"] == 1
            outs = [c.result(timeout=60) for c in calls]
            assert all(o[0].token_weight_versions == [1] * 3 for o in outs)
