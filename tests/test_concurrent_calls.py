"""Spec: generate calls in flight at once share the engine's batch (rollout/call_board.py).

The oracle is the same requests in one call: every concurrent call gets exactly its samples
(tokens equal, logprobs within fp32 rounding), and the engine ran them together — far fewer
steps than one call after another. Also: a call closed early, a step that fails, `abort_all`
and an in-place weight update while several calls run, memory release waiting for the open
calls, and requests built by many threads at once getting distinct ids; afterwards every KV slot
has one owner (overlap scheduling on and off)."""
from __future__ import annotations

import asyncio
import sys
import threading
import time

import numpy as np
import pytest

from rollout import Engine, EngineConfig, SamplingParams
from rollout.request_builder import PromptLimits, RequestBuilder
from tests.helpers import gpu, kv_pool_whole

ARCH = "Qwen2ForCausalLM"
PROMPTS = [[5 + i, 6, 7 + 2 * i, 9][: 2 + i % 3] for i in range(16)]
NEW = 12


def _sp(i: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": NEW, "temperature": 1.0, "seed": 100 + i,
                             "ignore_eos": True, **kw})


def _engine(tiny_dirs, overlap, **cfg) -> Engine:
    cfg.setdefault("kv_cache_tokens", 2048)
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], overlap_schedule=overlap,
                               prefix_cache=False, **cfg))


@pytest.fixture(params=[False, True], ids=["plain", "overlap"])
def overlap(request) -> bool:
    return request.param


@pytest.fixture()
def batched(tiny_dirs, overlap):
    """Every prompt's sample from one call of them all."""
    return _engine(tiny_dirs, overlap).generate(PROMPTS, [_sp(i) for i in range(len(PROMPTS))])


def _in_threads(fns) -> list:
    results, start = [None] * len(fns), threading.Barrier(len(fns))

    def run(i):
        start.wait()
        results[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call hung"
    return results


def _same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert np.allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_concurrent_calls_batch_together_and_each_gets_its_own_samples(tiny_dirs, overlap, batched):
    engine = _engine(tiny_dirs, overlap)
    outs = _in_threads([lambda i=i: engine.generate([PROMPTS[i]], _sp(i)) for i in range(len(PROMPTS))])
    for i, (out,) in enumerate(outs):
        assert out.prompt_token_ids == PROMPTS[i] and out.prompt_index == 0
        _same(out, batched[i])
    # one call after another would take len(PROMPTS) * NEW steps
    assert engine.stats.steps <= len(PROMPTS) * NEW // 3
    assert kv_pool_whole(engine.scheduler)


@gpu
def test_gpu_concurrent_calls_batch_together(tiny_dirs):
    """The GPU path in float32 (graphs, overlap): the steps move between the callers' threads."""
    cfg = dict(device="cuda", dtype="float32", kv_cache_tokens=None)
    want = _engine(tiny_dirs, None, **cfg).generate(PROMPTS, [_sp(i) for i in range(len(PROMPTS))])
    engine = _engine(tiny_dirs, None, **cfg)
    outs = _in_threads([lambda i=i: engine.generate([PROMPTS[i]], _sp(i)) for i in range(len(PROMPTS))])
    for i, (out,) in enumerate(outs):
        assert out.token_ids == want[i].token_ids
        assert np.allclose(out.logprobs, want[i].logprobs, atol=1e-3, rtol=0)
    assert engine.stats.steps <= len(PROMPTS) * NEW // 3
    assert kv_pool_whole(engine.scheduler)


def test_concurrent_calls_get_distinct_request_ids():
    """Calls build their requests in their own threads: every request gets its own id (the
    call board, drops and aborts find requests by it; two calls once drew the same one and a
    call waited for a request the scheduler no longer held), and a call's ids are one run. A
    switch interval of 1 µs makes threads interleave inside a build."""
    builder = RequestBuilder(PromptLimits(vocab_size=64, max_context=64, kv_capacity=64),
                             None, seed=0)
    calls: list = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _in_threads([lambda: calls.extend(builder.build([[1, 2], [3]], SamplingParams(n=3))
                                          for _ in range(200))] * 8)
    finally:
        sys.setswitchinterval(old)
    rids = [r.rid for call in calls for r in call]
    assert len(calls) == 1600 and sorted(rids) == list(range(len(rids)))
    assert all([r.rid for r in call] == list(range(call[0].rid, call[0].rid + 6)) for call in calls)


def test_agenerate_calls_gathered_batch_together(tiny_dirs, overlap, batched):
    engine = _engine(tiny_dirs, overlap)

    async def all_calls():
        return await asyncio.gather(*[engine.agenerate([p], _sp(i)) for i, p in enumerate(PROMPTS)])

    outs = asyncio.run(all_calls())
    for i, (out,) in enumerate(outs):
        _same(out, batched[i])
    assert engine.stats.steps <= len(PROMPTS) * NEW // 3
    assert kv_pool_whole(engine.scheduler)


def test_a_call_closed_early_leaves_the_others_running(tiny_dirs, overlap, batched):
    engine = _engine(tiny_dirs, overlap)
    mid = len(PROMPTS) // 2
    early = engine.generate_iter(PROMPTS[:mid], [_sp(0, max_new_tokens=1)]
                                 + [_sp(i) for i in range(1, mid)])
    first = next(early)  # the one-token sample; the rest of that call still runs
    assert first.prompt_index == 0 and len(first.token_ids) == 1
    other = threading.Thread(target=lambda: result.append(
        engine.generate(PROMPTS[mid:], [_sp(i) for i in range(mid, len(PROMPTS))])))
    result: list = []
    other.start()
    time.sleep(0.05)
    early.close()  # its unfinished samples go; the other call's do not
    other.join(timeout=120)
    for i, out in enumerate(result[0], start=mid):
        _same(out, batched[i])
    assert kv_pool_whole(engine.scheduler)


def test_a_failed_step_fails_every_call_in_flight_and_the_engine_recovers(tiny_dirs, overlap, batched):
    engine = _engine(tiny_dirs, overlap)
    run_batch, steps = engine.scheduler.run_batch, []

    def failing(fb):
        steps.append(fb)
        if len(steps) == 6:
            raise RuntimeError("injected step failure")
        return run_batch(fb)

    engine.scheduler.run_batch = failing

    def call(i):
        try:
            engine.generate([PROMPTS[i]], _sp(i))
        except RuntimeError as e:
            return str(e)
        return "finished"

    results = _in_threads([lambda i=i: call(i) for i in range(4)])
    assert results.count("injected step failure") >= 1
    assert set(results) <= {"injected step failure", "finished"}
    engine.scheduler.run_batch = run_batch
    assert kv_pool_whole(engine.scheduler)
    again = engine.generate(PROMPTS, [_sp(i) for i in range(len(PROMPTS))])
    for got, want in zip(again, batched):
        _same(got, want)


def _running_calls(engine: Engine, params: list[SamplingParams], decode_tokens: int):
    """One-prompt calls of `params` in threads, returned once the engine has decoded
    `decode_tokens` tokens; `join()` waits for them and gives their outputs."""
    results: list = [None] * len(params)

    def call(i):
        results[i] = engine.generate([PROMPTS[i]], params[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(params))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while engine.stats.decode_tokens < decode_tokens and time.monotonic() < deadline:
        time.sleep(0.002)

    def join() -> list:
        for t in threads:
            t.join(timeout=60)
        return results
    return join


def test_abort_all_ends_every_call_in_flight(tiny_dirs, overlap):
    engine = _engine(tiny_dirs, overlap)
    join = _running_calls(engine, [_sp(i, max_new_tokens=400) for i in range(4)], 40)
    assert engine.abort_all() >= 1
    results = join()
    assert all(r is not None and len(r) == 1 for r in results)
    assert all(r[0].finish_reason in ("abort", "length") for r in results)
    assert any(r[0].finish_reason == "abort" for r in results)
    assert kv_pool_whole(engine.scheduler)


def test_an_in_place_update_while_calls_run(tiny_dirs):
    engine = _engine(tiny_dirs, False, pause_mode="in_place")
    join = _running_calls(engine, [_sp(i, max_new_tokens=40) for i in range(4)], 12)
    with engine.paused("in_place"):
        engine.commit_weight_version(engine.weight_version + 1)
    for (out,) in join():
        assert len(out.token_ids) == 40 and out.token_weight_versions[-1] == 1
        assert out.token_weight_versions == sorted(out.token_weight_versions)
    assert kv_pool_whole(engine.scheduler)


def test_release_memory_waits_for_the_calls_open(tiny_dirs):
    engine = _engine(tiny_dirs, False)
    it = engine.generate_iter(PROMPTS[:2], [_sp(0, max_new_tokens=1), _sp(1)])
    next(it)  # the call is open: its second sample still runs
    released = threading.Event()
    worker = threading.Thread(target=lambda: (engine.release_memory(), released.set()))
    worker.start()
    assert not released.wait(0.3), "memory was released under an open call"
    assert len(list(it)) == 1  # the call runs to its end
    worker.join(timeout=60)
    assert released.is_set()
    engine.resume_memory()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_random_concurrent_calls_closes_and_aborts_never_hang_or_leak(tiny_dirs, overlap):
    """Twelve threads of random calls — whole, streamed and closed after their first sample,
    repeating earlier prompts (the prefix cache on) — in a 64-slot pool that evicts and
    retracts, while another thread aborts requests: every call returns in time, every sample
    is whole or aborted, and every slot has one owner afterwards."""
    import random
    engine = Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=64,
                                 overlap_schedule=overlap))
    stop = threading.Event()

    def caller(k: int) -> int:
        rng, done = random.Random(k), 0
        for _ in range(5):
            prompts = [PROMPTS[rng.randrange(len(PROMPTS))] for _ in range(rng.randrange(1, 4))]
            params = [_sp(rng.randrange(100), max_new_tokens=rng.randrange(1, 40)) for _ in prompts]
            if rng.random() < 0.3:
                it = engine.generate_iter(prompts, params)
                next(it, None)
                it.close()
                continue
            for out, sp in zip(engine.generate(prompts, params), params):
                assert out.finish_reason in ("length", "abort")
                assert len(out.token_ids) == sp.max_new_tokens or out.finish_reason == "abort"
            done += 1
        return done

    def aborter():
        rng = random.Random(99)
        while not stop.is_set():
            time.sleep(0.005)
            held = list(engine.scheduler.running)
            if held and rng.random() < 0.3:
                engine.abort(rng.choice(held).rid)

    side = threading.Thread(target=aborter)
    side.start()
    try:
        finished = _in_threads([lambda k=k: caller(k) for k in range(12)])
    finally:
        stop.set()
        side.join(timeout=30)
    assert sum(finished) > 0
    stats = engine.stats
    assert stats.retractions and stats.evicted_tokens and stats.cached_prompt_tokens and stats.aborted
    assert kv_pool_whole(engine.scheduler)
