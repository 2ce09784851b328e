"""Spec: the prefix cache (rollout/prefix_cache.py) — a sample's KV stays cached after it leaves,
and a later request that starts with its tokens computes only the rest.

The oracles: for the tree, a model in which every slot is labelled with the exact token prefix
whose KV it holds (a match must return, position by position, slots labelled with the request's
own prefix; every slot has one owner); for the engine, the same engine with `prefix_cache=False`
(the same tokens, logprobs within fp32 rounding), HF's greedy `generate`, and a fresh engine
after a weight update. Multi-turn conversations, GRPO groups whose prompt is cached, a KV pool
so small that cached KV is evicted and requests retracted, weight updates (a repeated version
too, and in place while requests run), aborts and the release of the KV memory; every slot back
with exactly one owner after each call."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.errors import ConfigError
from rollout.prefix_cache import PrefixCache
from tests.helpers import gpu, hf_model, kv_pool_whole

ARCH = "Qwen2ForCausalLM"
TURN1 = [[3, 14, 15, 92, 65, 35], [46, 7], [26, 43, 38, 32, 79, 50, 28, 84, 19, 71], [69, 39, 9]]


def _ids(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# ---- the tree -------------------------------------------------------------------------------
def test_match_splits_an_edge_and_insert_hands_back_duplicates():
    cache = PrefixCache()
    node, own = cache.insert(_ids(1, 2, 3, 4), _ids(10, 11, 12, 13))
    assert len(own) == 0 and cache.num_tokens == 4
    node, n = cache.match(_ids(1, 2, 9))
    assert n == 2 and cache.path_slots(node).tolist() == [10, 11]
    # a second sequence through the split: its first two slots are duplicates, the rest taken
    node, own = cache.insert(_ids(1, 2, 5, 6), _ids(20, 21, 22, 23))
    assert own.tolist() == [20, 21] and cache.num_tokens == 6
    node, n = cache.match(_ids(1, 2, 5, 6, 7))
    assert n == 4 and cache.path_slots(node).tolist() == [10, 11, 22, 23]
    # slots before own_from are another owner's: never handed back, never taken
    _, own = cache.insert(_ids(1, 2, 5, 6, 8), _ids(10, 11, 22, 23, 30), own_from=4)
    assert own.tolist() == [] and cache.match(_ids(1, 2, 5, 6, 8))[1] == 5
    _, own = cache.insert(_ids(7, 7, 7), _ids(40, 41, 42), own_from=2)  # its prefix is not cached
    assert own.tolist() == [42] and cache.match(_ids(7, 7, 7))[1] == 0


def test_eviction_is_lru_over_unlocked_leaves():
    cache = PrefixCache()
    cache.insert(_ids(1, 2, 3), _ids(1, 2, 3))
    cache.insert(_ids(5, 6), _ids(5, 6))
    cache.insert(_ids(1, 2, 4), _ids(7, 8, 9))  # slots 7, 8 duplicate 1, 2: handed back
    locked, _ = cache.match(_ids(1, 2, 3))
    cache.lock(locked)
    cache.match(_ids(5, 6))  # used after (1, 2, 4)
    assert sorted(cache.evict(1).tolist()) == [9]  # the least recently used unlocked leaf
    assert sorted(cache.evict(1).tolist()) == [5, 6]
    assert cache.evict(10).tolist() == []  # the rest is held
    assert cache.evictable_tokens() == 0
    cache.unlock(locked)
    assert sorted(cache.evict(10).tolist()) == [1, 2, 3] and cache.num_tokens == 0


def test_invalidate_frees_unused_nodes_and_stales_the_held_ones():
    cache = PrefixCache(version=0)
    cache.insert(_ids(1, 2, 3), _ids(1, 2, 3))
    cache.insert(_ids(4, 5), _ids(4, 5))
    held, _ = cache.match(_ids(1, 2))  # splits (1, 2 | 3)
    cache.lock(held)
    assert sorted(cache.invalidate(1).tolist()) == [3, 4, 5]
    assert cache.version == 1 and cache.match(_ids(1, 2, 3)) == (cache.root, 0)
    cache.insert(_ids(1, 2), _ids(6, 7))  # the new weights' KV of the same tokens
    assert sorted(cache.unlock(held).tolist()) == [1, 2]  # stale: freed with its last holder
    assert cache.path_slots(cache.match(_ids(1, 2))[0]).tolist() == [6, 7]
    assert sorted(cache.clear().tolist()) == [6, 7] and cache.num_tokens == 0


def test_random_operations_keep_every_slot_with_one_owner_and_the_right_prefix():
    """Random sequences over a 3-token alphabet (many shared prefixes), random inserts of rows
    built on matches, locks, unlocks, evictions and invalidations: a matched slot always holds
    the KV of exactly the request's prefix, and every slot has exactly one owner."""
    rng = random.Random(5)
    cache, free = PrefixCache(), list(range(1, 2001))
    label: dict[int, tuple] = {}  # slot -> (version, the token prefix whose KV it holds)
    held: list = []
    version = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.55:
            seq = _ids(*[rng.randrange(3) for _ in range(rng.randrange(1, 12))])
            node, n = cache.match(seq)
            slots = cache.path_slots(node)
            for p in range(n):
                assert label[int(slots[p])] == (version, tuple(seq[:p + 1].tolist()))
            new = [free.pop() for _ in range(len(seq) - n)]
            for p, s in enumerate(new, start=n):
                label[s] = (version, tuple(seq[:p + 1].tolist()))
            row = np.concatenate([slots, np.array(new, dtype=np.int64)])
            if n:
                cache.lock(node)
            _, untaken = cache.insert(seq, row, own_from=n)
            free.extend(untaken.tolist())
            if n:
                if rng.random() < 0.5:
                    held.append(node)
                else:
                    free.extend(cache.unlock(node).tolist())
        elif op < 0.75 and held:
            free.extend(cache.unlock(held.pop(rng.randrange(len(held)))).tolist())
        elif op < 0.95:
            free.extend(cache.evict(rng.randrange(1, 20)).tolist())
        else:
            version += 1
            free.extend(cache.invalidate(version).tolist())
        tree = [int(s) for x in cache._nodes() for s in x.slots]
        stale = [int(s) for x in _stale_nodes(held) for s in x.slots]
        owners = sorted(free + tree + stale)
        assert owners == list(range(1, 2001)), "a slot lost or owned twice"
    for node in held:
        free.extend(cache.unlock(node).tolist())
    free.extend(cache.clear().tolist())
    assert sorted(free) == list(range(1, 2001))


def _stale_nodes(held):
    seen = {}
    for node in held:
        while not node.is_root:
            if node.stale:
                seen[id(node)] = node
            node = node.parent
    return list(seen.values())


# ---- the engine -----------------------------------------------------------------------------
def _engine(tiny_dirs, cache: bool = True, **cfg) -> Engine:
    cfg.setdefault("kv_cache_tokens", 4096)
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], prefix_cache=cache, **cfg))


def _sp(**kw) -> SamplingParams:
    kw = {"max_new_tokens": 8, "temperature": 1.0, "seed": 3, "ignore_eos": True, **kw}
    return SamplingParams(**kw)


def _next_turn(outs, extra_seed: int) -> list[list[int]]:
    """Each conversation's next prompt: the last prompt, its sample and a 'tool reply'."""
    rng = random.Random(extra_seed)
    return [o.prompt_token_ids + o.token_ids + [rng.randrange(1, 250) for _ in range(3)]
            for o in outs]


def _assert_same(got, want, atol=1e-4):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert np.allclose(a.logprobs, b.logprobs, atol=atol, rtol=0)
        assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_multi_turn_conversations_reuse_the_last_turn_and_sample_the_same(tiny_dirs, overlap):
    cached, plain = _engine(tiny_dirs, True, overlap_schedule=overlap), _engine(tiny_dirs, False)
    prompts = TURN1
    for turn in range(3):
        got, want = cached.generate(prompts, _sp(seed=turn)), plain.generate(prompts, _sp(seed=turn))
        _assert_same(got, want)
        for o in got:
            # everything of the last turn but its last sampled token, whose KV was never computed
            expect = 0 if turn == 0 else len(prompts[o.prompt_index]) - 4
            assert o.cached_tokens == expect
        assert kv_pool_whole(cached.scheduler)
        prompts = _next_turn(got, turn)
    assert cached.stats.cached_prompt_tokens > 0 and plain.stats.cached_prompt_tokens == 0
    assert cached.stats.prefill_tokens < plain.stats.prefill_tokens


def test_greedy_continuations_from_cached_kv_are_hf_greedy(tiny_dirs):
    engine, hf = _engine(tiny_dirs), hf_model(tiny_dirs[ARCH])
    first = engine.generate(TURN1, _sp(temperature=0.0))
    second = engine.generate(_next_turn(first, 9), _sp(temperature=0.0))
    assert all(o.cached_tokens > 0 for o in second)
    for o in second:
        want = hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=8, do_sample=False)
        assert o.token_ids == want[0, len(o.prompt_token_ids):].tolist()


@pytest.mark.parametrize("share", [True, False], ids=["group", "alone"])
def test_grpo_samples_of_a_cached_prompt(tiny_dirs, share):
    """n samples of each next-turn prompt: the group's leader finds the last turn cached and
    its followers share what it computes (or, without sharing, each finds the cache)."""
    cached = _engine(tiny_dirs, True, share_prompt_kv=share)
    plain = _engine(tiny_dirs, False, share_prompt_kv=share)
    first = cached.generate(TURN1, _sp())
    _assert_same(first, plain.generate(TURN1, _sp()))
    prompts = _next_turn(first, 4)
    before = cached.stats.prefill_tokens
    got, want = cached.generate(prompts, _sp(n=4, seed=8)), plain.generate(prompts, _sp(n=4, seed=8))
    _assert_same(got, want)
    new_tokens = [3 + 1 for _ in prompts]  # the tool reply and the last turn's last token
    if share:  # one computes the new part, the other three only their last token
        assert cached.stats.prefill_tokens - before == sum(t + 3 for t in new_tokens)
    else:
        assert cached.stats.prefill_tokens - before == 4 * sum(new_tokens)
    assert kv_pool_whole(cached.scheduler)
    again = cached.generate(prompts, _sp(n=4, seed=8))  # now the whole prompt is cached
    _assert_same(again, want)
    assert all(o.cached_tokens == len(o.prompt_token_ids) - 1 for o in again[::4])
    assert kv_pool_whole(cached.scheduler)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_system_prompt_computed_in_one_step_serves_the_calls_later_steps(tiny_dirs, overlap):
    """A prefill budget of two prompts: the first step computes the shared system prompt
    twice (the second copy's slots are its own duplicates, freed when it leaves), every later
    admission of the call finds it cached."""
    system = list(range(30, 54))
    prompts = [system + [100 + i, 7, 8] for i in range(8)]
    cfg = dict(max_prefill_tokens=2 * len(prompts[0]), overlap_schedule=overlap)
    cached, plain = _engine(tiny_dirs, True, **cfg), _engine(tiny_dirs, False, **cfg)
    got = cached.generate(prompts, _sp())
    _assert_same(got, plain.generate(prompts, _sp()))
    assert [o.cached_tokens for o in got] == [0, 0] + [len(system)] * 6
    assert kv_pool_whole(cached.scheduler)


def test_a_group_whose_prompt_another_request_of_its_step_computed(tiny_dirs):
    """Q and the group of P (n = 3) start with the same system prompt and go in one step, Q
    first: the tree takes Q's copy, so the leader's copy is duplicates that its followers read
    in that step; the group owns them until its last sample leaves."""
    system = list(range(60, 80))
    q, p = system + [9, 9], system + [5, 6, 7]
    params = [_sp(), _sp(n=3, seed=4)]
    cached, plain = _engine(tiny_dirs, True), _engine(tiny_dirs, False)
    got, want = cached.generate([q, p], params), plain.generate([q, p], params)
    _assert_same(got, want)
    assert cached.stats.prefill_tokens == len(q) + len(p) + 2  # one step: nothing found cached
    assert kv_pool_whole(cached.scheduler)
    again = cached.generate([p], _sp(n=3, seed=4))
    _assert_same(again, want[1:])
    assert again[0].cached_tokens == len(p) - 1 and kv_pool_whole(cached.scheduler)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_small_pool_evicts_cached_kv_before_it_retracts(tiny_dirs, overlap):
    cached = _engine(tiny_dirs, True, kv_cache_tokens=160, overlap_schedule=overlap)
    plain = _engine(tiny_dirs, False, kv_cache_tokens=160)
    rng, got = random.Random(2), []
    for call in range(6):
        prompts = [[rng.randrange(1, 250) for _ in range(rng.randrange(4, 12))] for _ in range(6)]
        if call % 2:  # every other call continues the last one's conversations
            prompts = _next_turn(got, call)[:3] + prompts[:3]
        sp = _sp(seed=call, max_new_tokens=12)
        got = cached.generate(prompts, sp)
        _assert_same(got, plain.generate(prompts, sp))
        assert kv_pool_whole(cached.scheduler)
        assert cached.scheduler.cache.num_tokens <= 160
    assert cached.stats.evicted_tokens > 0 and cached.stats.cached_prompt_tokens > 0


def test_weight_updates_empty_the_cache_even_for_a_repeated_version(tiny_dirs):
    engine = _engine(tiny_dirs)
    hf = hf_model(tiny_dirs[ARCH])
    first = engine.generate(TURN1, _sp(temperature=0.0))
    prompts = _next_turn(first, 1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for version in (1, 1):  # a trainer may push the same version number again
        assert engine.update_weights_from_tensor(list(hf.named_parameters()), version=version) == 1
        assert kv_pool_whole(engine.scheduler) and engine.scheduler.cache.num_tokens == 0
        got = engine.generate(prompts, _sp(temperature=0.0))
        assert all(o.cached_tokens == 0 for o in got)
        for o in got:
            want = hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=8, do_sample=False)
            assert o.token_ids == want[0, len(o.prompt_token_ids):].tolist()


def test_requests_running_through_an_in_place_update_keep_their_kv_but_cache_none(tiny_dirs):
    engine = _engine(tiny_dirs)
    first = engine.generate(TURN1, _sp())
    prompts = _next_turn(first, 2)
    sched = engine.scheduler
    reqs = engine._requests.build(prompts, _sp(max_new_tokens=10))
    for r in reqs:
        sched.add(r)
    for _ in range(3):
        sched.step()
    assert all(r.cache_node is not None for r in reqs)  # their prefixes came from the cache
    with engine.paused("in_place"):
        engine.commit_weight_version(engine.weight_version + 1)
    assert all(r.cache_node.stale for r in reqs) and sched.cache.num_tokens > 0
    while sched.has_work:
        sched.step()
    assert all(r.finish_reason == "length" and len(r.output_ids) == 10 for r in reqs)
    assert sched.cache.num_tokens == 0  # the stale KV went with its last holder; nothing mixed
    assert kv_pool_whole(sched)


def test_aborted_samples_are_cached_and_release_memory_drops_the_cache(tiny_dirs):
    engine = _engine(tiny_dirs)
    it = engine.generate_iter(TURN1, [_sp(max_new_tokens=2)] + [_sp(max_new_tokens=64)] * 3)
    assert next(it).finish_reason == "length"
    engine.abort_all()
    outs = list(it)
    assert outs and all(o.finish_reason == "abort" for o in outs)
    assert kv_pool_whole(engine.scheduler) and engine.scheduler.cache.num_tokens > 0
    prompts = [o.prompt_token_ids + o.token_ids for o in outs]
    again = engine.generate(prompts, _sp())
    assert all(o.cached_tokens == len(o.prompt_token_ids) - 1 for o in again)
    engine.release_memory(("kv_cache",))
    assert engine.scheduler.cache.num_tokens == 0
    engine.resume_memory(("kv_cache",))
    assert kv_pool_whole(engine.scheduler)
    fresh = engine.generate(prompts, _sp())
    assert all(o.cached_tokens == 0 for o in fresh)
    _assert_same(fresh, again)


@gpu
def test_gpu_multi_turn_with_the_cache_samples_what_the_cache_off_engine_does(tiny_dirs):
    """On the GPU path (Triton attention, decode and prefill CUDA graphs, overlap) in float32:
    a next turn, alone (the one-request prefill graph after its cached prefix) and with others
    and n = 3 samples of each, equals the cache-off engine's."""
    cfg = dict(device="cuda", dtype="float32")
    cached, plain = _engine(tiny_dirs, True, **cfg), _engine(tiny_dirs, False, **cfg)
    first = cached.generate(TURN1, _sp())
    _assert_same(first, plain.generate(TURN1, _sp()), atol=1e-3)
    prompts = _next_turn(first, 6)
    for batch, n in ((prompts[:1], 1), (prompts, 3)):
        got, want = cached.generate(batch, _sp(n=n)), plain.generate(batch, _sp(n=n))
        _assert_same(got, want, atol=1e-3)
        assert got[0].cached_tokens > 0 and kv_pool_whole(cached.scheduler)
    assert cached.runner.graph_runner.prefill.num_replays > 0


def test_prefix_cache_must_be_a_bool(tiny_dirs):
    with pytest.raises(ConfigError, match="prefix_cache"):
        EngineConfig(model_path=tiny_dirs[ARCH], prefix_cache="yes")
