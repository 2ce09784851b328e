"""Spec for RolloutController on one machine (CPU, local Ray):

- DP=2 × TP=1 and DP=1 × TP=2 return what the single-process Engine returns for the same
  config and seeds: greedy, seeded sampling with n > 1, string prompts, stop strings, and
  prompts without a seed (the controller draws their seeds exactly as an Engine does).
- All n samples of a prompt run on one replica; the async forms give the same outputs.
- `abort_all` ends the calls in flight on every replica: each returns all its samples, the
  unfinished ones with a prefix of what the engine returns for the same seeds.
- A tp_size that does not divide the heads, more bundles than the cluster has, or a placement
  that cannot complete: a typed error, and nothing left in the cluster."""
from __future__ import annotations

import asyncio
import dataclasses
import string
import time

import pytest
import torch

from actors import PlacementError, RolloutController
from rollout import ConfigError, Engine, EngineConfig, InvalidRequestError, SamplingParams
from tests.ray_helpers import live_objects, local_ray, wait_for_live_objects

pytestmark = pytest.mark.ray

ARCH = "Qwen3ForCausalLM"
NUM_CPUS = 8  # two module controllers (4 shards) + room for a fresh pair in one test
RAGGED = [[3, 14, 15], [92, 65, 35, 89, 79, 32, 38], [46], [26, 43, 38, 32, 79, 50, 28, 84, 19, 71],
          "hello world", [93, 75, 10, 58, 20], [97, 49, 44, 59, 23, 7], [81, 64, 6, 28]]
PARAMS = [SamplingParams(max_new_tokens=12, temperature=0.0),
          SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, n=3),
          SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=5, logprobs=2),
          SamplingParams(max_new_tokens=20, temperature=1.0, top_k=30, seed=7,
                         stop=tuple(string.printable[:94])),  # stops at an ASCII character
          SamplingParams(max_new_tokens=10, temperature=0.0),
          SamplingParams(max_new_tokens=14, temperature=1.0, seed=3, n=2),
          SamplingParams(max_new_tokens=6, temperature=1.0, min_p=0.1, seed=2),
          SamplingParams(max_new_tokens=18, temperature=0.7, seed=1)]


def config(tiny_dirs, tp_size: int = 1) -> EngineConfig:
    return EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096, tp_size=tp_size)


@pytest.fixture(scope="module")
def ray_session():
    with local_ray(NUM_CPUS):
        yield


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine(config(tiny_dirs))


@pytest.fixture(scope="module")
def controllers(tiny_dirs, ray_session):
    ctls = {"dp2": RolloutController(config(tiny_dirs), num_replicas=2),
            "tp2": RolloutController(config(tiny_dirs, tp_size=2), num_replicas=1)}
    yield ctls
    for c in ctls.values():
        c.shutdown()


def assert_same(outs, refs, atol=1e-5):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert (o.prompt_index, o.sample_index) == (r.prompt_index, r.sample_index)
        assert o.prompt_token_ids == r.prompt_token_ids
        assert o.token_ids == r.token_ids
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=atol)
        assert [[t for t, _ in s] for s in o.top_logprobs] == [[t for t, _ in s] for s in r.top_logprobs]
        assert (o.finish_reason, o.weight_version, o.text) == (r.finish_reason, r.weight_version, r.text)


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_outputs_equal_single_engine_for_same_seeds(controllers, engine, layout):
    refs = engine.generate(RAGGED, PARAMS)
    outs = controllers[layout].generate(RAGGED, PARAMS)
    assert_same(outs, refs)
    assert [o.prompt_index for o in outs] == [i for i, sp in enumerate(PARAMS) for _ in range(sp.n)]
    assert outs[PARAMS[0].n + PARAMS[1].n + PARAMS[2].n].finish_reason == "stop"  # a stop string


@pytest.mark.parametrize("tp_size,num_replicas", [(1, 2), (2, 1)])
def test_seed_none_is_drawn_like_an_engine(tiny_dirs, ray_session, tp_size, num_replicas):
    """Fresh controller and fresh Engine, same config seed: two calls in a row agree."""
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, n=2)
    single = Engine(config(tiny_dirs))
    with RolloutController(config(tiny_dirs, tp_size), num_replicas=num_replicas) as ctl:
        for _ in range(2):
            assert_same(ctl.generate(RAGGED[:5], sp), single.generate(RAGGED[:5], sp))


def test_n_samples_of_a_prompt_stay_on_one_replica(controllers):
    ctl = controllers["dp2"]
    before = [r["shards"][0]["stats"]["prefill_tokens"] for r in ctl.status()]
    # 7 and 10 tokens no earlier call gave (nothing of them cached); idle replicas: i → replica i
    prompts = [[253] + RAGGED[1][1:], [254] + RAGGED[3][1:]]
    outs = ctl.generate(prompts, SamplingParams(max_new_tokens=4, n=3, seed=1))
    after = [r["shards"][0]["stats"]["prefill_tokens"] for r in ctl.status()]
    # each replica computed its prompt once and one token for each other sample (the samples
    # share the prompt's KV: prompt_group) — impossible were the samples split over replicas
    assert [a - b for a, b in zip(after, before)] == [7 + 2, 10 + 2]
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, k) for i in range(2) for k in range(3)]
    assert all(r["alive"] and r["outstanding_work"] == 0 for r in ctl.status())


def test_copies_of_a_prompt_go_where_its_first_copy_goes(controllers, engine):
    """A prompt given again in the call follows its first copy to that replica, where their
    samples share the prompt's KV: the first replica computes prompt 7 tokens + 1, the other
    the 10-token prompt; the outputs are the single engine's. (Prompts no earlier call gave:
    the replicas' prefix caches hold nothing of them.)"""
    ctl = controllers["dp2"]
    before = [r["shards"][0]["stats"]["prefill_tokens"] for r in ctl.status()]
    seven, ten = [251] + RAGGED[1][1:], [252] + RAGGED[3][1:]
    prompts = [seven, ten, seven]  # idle replicas: 0, 1, then the copy to 0
    sp = SamplingParams(max_new_tokens=4, seed=3)
    outs = ctl.generate(prompts, sp)
    after = [r["shards"][0]["stats"]["prefill_tokens"] for r in ctl.status()]
    assert [a - b for a, b in zip(after, before)] == [7 + 1, 10]
    assert_same(outs, engine.generate(prompts, sp))
    assert all(r["alive"] and r["outstanding_work"] == 0 for r in ctl.status())


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_next_turns_go_where_their_conversation_is_cached(controllers, engine, layout):
    """Turn 2 of each conversation (turn 1's prompt and sample, then a 'tool reply') runs on the
    replica that served turn 1 — given in reverse order, where the least-loaded assignment alone
    would swap them — and finds all of turn 1 but its last token cached; the outputs are the
    single engine's (TP: the followers read the cached prefix too)."""
    ctl = controllers[layout]
    turn1 = [[240 + i, 5, 6, 7, 8 + i] for i in range(4)]  # prompts no other test gives
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=4, ignore_eos=True)
    first = ctl.generate(turn1, sp)
    assert_same(first, engine.generate(turn1, sp))
    turn2 = [o.prompt_token_ids + o.token_ids + [9, 10] for o in first][::-1]
    got = ctl.generate(turn2, sp)
    assert_same(got, engine.generate(turn2, sp))
    assert [o.cached_tokens for o in got] == [len(p) - 3 for p in turn2]


def test_concurrent_calls_batch_on_a_replica(controllers, engine):
    """Eight one-prompt `generate_async` calls in flight at once on one replica (TP=2) share its
    batch: it takes far fewer steps than the calls one after another would (8 × 16), and each
    call gets the single engine's samples."""
    ctl = controllers["tp2"]
    sps = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=60 + i, ignore_eos=True)
           for i in range(8)]
    prompts = [[230 + i, 3, 4] for i in range(8)]
    before = ctl.status()[0]["shards"][0]["stats"]["steps"]
    futures = [ctl.generate_async([p], sp) for p, sp in zip(prompts, sps)]
    outs = [f.result(timeout=120) for f in futures]
    assert ctl.status()[0]["shards"][0]["stats"]["steps"] - before < 8 * 16 // 2
    for out, p, sp in zip(outs, prompts, sps):
        assert_same(out, engine.generate([p], sp))


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_score_equals_the_single_engines(controllers, engine, layout):
    """`score` spread over the replicas (dp2) or through a TP group's followers (tp2)."""
    seqs = [[3, 14, 15, 92, 65], [46, 7, 9], [(7 * j) % 500 + 1 for j in range(30)], "hello world"]
    starts = [1, 2, 10, 1]
    got = controllers[layout].score(seqs, start=starts, temperature=0.8)
    want = engine.score(seqs, start=starts, temperature=0.8)
    assert [len(g) for g in got] == [len(w) for w in want] == [4, 1, 20, len(want[3])]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


def test_async_forms_equal_generate(controllers, engine):
    ctl = controllers["dp2"]
    sps = [SamplingParams(max_new_tokens=6, seed=i) for i in range(4)]
    futures = [ctl.generate_async(RAGGED[:4], sps), ctl.generate_async(RAGGED[4:], sps)]
    got = [f.result(timeout=60) for f in futures]
    assert_same(got[0], engine.generate(RAGGED[:4], sps))
    assert_same(got[1], engine.generate(RAGGED[4:], sps))
    assert_same(asyncio.run(ctl.agenerate(RAGGED[:4], sps)), got[0])


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_abort_all_ends_the_calls_in_flight_with_every_sample(controllers, engine, layout):
    ctl = controllers[layout]
    sps = [SamplingParams(max_new_tokens=900, temperature=1.0, seed=20 + i, ignore_eos=True)
           for i in range(4)]
    future = ctl.generate_async(RAGGED[:4], sps)
    time.sleep(0.2)
    ended, deadline = 0, time.monotonic() + 60
    while ended < 4:  # a replica's call may not have reached its engine yet: again until it has
        assert not future.done() and time.monotonic() < deadline, f"{ended} of 4 ended"
        ended += ctl.abort_all()
        time.sleep(0.02)
    outs = future.result(timeout=60)
    assert [o.prompt_index for o in outs] == [0, 1, 2, 3]
    assert all(o.finish_reason == "abort" and len(o.token_ids) < 900 for o in outs)
    longest = max(1, max(len(o.token_ids) for o in outs))
    refs = engine.generate(RAGGED[:4], [dataclasses.replace(sp, max_new_tokens=longest) for sp in sps])
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids[:len(o.token_ids)]
    assert ctl.abort_all() == 0


def test_invalid_requests_raise_the_engines_errors(controllers):
    ctl = controllers["dp2"]
    with pytest.raises(InvalidRequestError, match="unknown generate"):
        ctl.generate([[1, 2]], bogus=1)
    with pytest.raises(InvalidRequestError, match="outside"):  # found by the replica, typed here
        ctl.generate([[1, 2], [1, 10**6]], SamplingParams(max_new_tokens=2))
    assert all(r["outstanding_work"] == 0 for r in ctl.status())


def test_bad_tp_size_fails_before_anything_is_created(tiny_dirs, ray_session):
    before = live_objects()
    with pytest.raises(ConfigError, match="tp_size=3 does not divide"):
        RolloutController(config(tiny_dirs, tp_size=3), num_replicas=1)
    assert live_objects() == before


def test_more_bundles_than_the_cluster_has(tiny_dirs, ray_session):
    before = live_objects()
    with pytest.raises(PlacementError, match="room for 4 group"):
        RolloutController(config(tiny_dirs, tp_size=2), num_replicas=5)  # 10 CPUs > 8
    assert live_objects() == before


def test_placement_that_cannot_complete_times_out_and_cleans_up(tiny_dirs, controllers):
    """4 of 8 CPUs are held by the module's controllers: replicas 0-3 start, replica 4's
    placement group times out, and everything made so far is destroyed."""
    before = wait_for_live_objects(live_objects())
    with pytest.raises(PlacementError, match="not placed within"):
        RolloutController(config(tiny_dirs), num_replicas=5, placement_timeout_s=2.0)
    assert wait_for_live_objects(before) == before
    assert controllers["dp2"].generate([[1, 2]], SamplingParams(max_new_tokens=2))  # still serving
