"""Spec: no request lost, no hang, nothing of one call leaking into the next — on the paths where
a call does not end normally. A step that raises, an iterator closed half-way, an abort from
another thread, KV that went missing, a pause that fails, a bad update while requests generate:
afterwards the engine's KV pool is whole again and its next call returns exactly what a fresh
engine returns (overlap scheduling on and off)."""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

import pytest

from rollout import Engine, EngineConfig, KVCacheBudgetError, SamplingParams, WeightUpdateError
from tests.helpers import hf_model, kv_pool_whole
from tests.test_weight_sync import perturb

ARCH = "Qwen2ForCausalLM"
PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20, 21], [30, 31, 32]]
SP = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
NEXT = [[40, 41, 42]]


def _engine(tiny_dirs, overlap: bool, **cfg) -> Engine:
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=256, overlap_schedule=overlap,
                               **cfg))


def _tokens(outs) -> list[tuple[int, list[int]]]:
    return [(o.prompt_index, o.token_ids) for o in outs]


@pytest.fixture(params=[False, True], ids=["plain", "overlap"])
def overlap(request) -> bool:
    return request.param


@pytest.fixture()
def reference(tiny_dirs, overlap):
    """What a fresh engine returns for the next call."""
    return _tokens(_engine(tiny_dirs, overlap).generate(NEXT, SP))


@contextmanager
def _fails_within(seconds: int):
    """A hang fails the test (SIGALRM interrupts a blocked lock or a spinning loop) instead of
    stalling the suite."""
    def alarm(signum, frame):
        raise TimeoutError(f"still blocked after {seconds} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _whole(engine: Engine) -> bool:
    """Every KV slot and request row free, no request left anywhere."""
    return kv_pool_whole(engine.scheduler)


def test_a_step_that_raises_leaves_nothing_behind(tiny_dirs, overlap, reference):
    engine = _engine(tiny_dirs, overlap)
    run_batch, calls = engine.scheduler.run_batch, []

    def failing(fb):  # the third step raises (a device error, a kernel bug)
        calls.append(fb)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return run_batch(fb)

    engine.scheduler.run_batch = failing
    with pytest.raises(RuntimeError, match="injected step failure"):
        engine.generate(PROMPTS, SP)
    engine.scheduler.run_batch = run_batch
    assert _whole(engine)
    assert _tokens(engine.generate(NEXT, SP)) == reference


def test_an_iterator_closed_half_way_leaves_nothing_behind(tiny_dirs, overlap, reference):
    engine = _engine(tiny_dirs, overlap)
    it = engine.generate_iter(PROMPTS, [SamplingParams(max_new_tokens=1 + 4 * i, seed=i, ignore_eos=True)
                                        for i in range(len(PROMPTS))])
    first = next(it)
    assert first.prompt_index == 0 and len(first.token_ids) == 1
    it.close()
    assert _whole(engine)
    assert _tokens(engine.generate(NEXT, SP)) == reference  # only its own output


def test_a_stream_moving_between_pool_threads_and_another_call_both_finish(tiny_dirs, overlap):
    """A generate_iter advanced from whichever pool thread is free while another task's call
    waits for the engine: the other call waits (no false error), then runs."""
    import asyncio
    engine = _engine(tiny_dirs, overlap)

    async def stream():
        it, outs = engine.generate_iter(PROMPTS, SP), []
        while (out := await asyncio.to_thread(next, it, None)) is not None:
            outs.append(out)
        return outs

    async def both():
        return await asyncio.gather(stream(), engine.agenerate(NEXT, SP), stream())

    with _fails_within(60):
        first, other, second = asyncio.run(both())
    assert len(first) == len(second) == len(PROMPTS) and len(other) == 1
    assert _tokens(sorted(first, key=lambda o: o.prompt_index)) == _tokens(
        sorted(second, key=lambda o: o.prompt_index))
    assert _whole(engine)


def test_the_thread_that_paused_can_abort_drop_a_call_and_shut_down(tiny_dirs, overlap):
    """A pause stops steps, not the pausing thread: inside its own pause it can abort a request,
    close an open stream (its requests are dropped) and shut the engine down."""
    engine = _engine(tiny_dirs, overlap)
    it = engine.generate_iter(PROMPTS, [SamplingParams(max_new_tokens=1 + 4 * i, seed=i, ignore_eos=True)
                                        for i in range(len(PROMPTS))])
    next(it)
    rid = engine.scheduler.running[-1].rid
    with _fails_within(20), engine.paused():
        assert engine.abort(rid)
        it.close()
    assert _whole(engine)
    engine.pause_generation()
    with _fails_within(20):
        engine.shutdown()


def test_aborts_from_another_thread_lose_no_request_and_leak_no_kv(tiny_dirs, overlap):
    engine = _engine(tiny_dirs, overlap)
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1, ignore_eos=True)
    for call in range(10):
        started = threading.Event()
        rids: list[int] = []

        def aborter():  # spread over the call's steps, racing them
            started.wait(timeout=30)
            for rid in rids[1::2]:
                engine.abort(rid)
                time.sleep(0.002)

        worker = threading.Thread(target=aborter)
        worker.start()
        outs = []
        params = [SamplingParams(max_new_tokens=1, seed=1)] + [sp] * (len(PROMPTS) * 2 - 1)
        for out in engine.generate_iter(PROMPTS * 2, params):  # the first output comes at once
            outs.append(out)
            if not started.is_set():  # between two steps: the unfinished requests' ids
                s = engine.scheduler
                rids.extend(r.rid for r in s.running + list(s.waiting))
                started.set()
        worker.join(timeout=30)
        assert sorted(o.prompt_index for o in outs) == list(range(len(PROMPTS) * 2))
        assert all(o.finish_reason in ("length", "abort") for o in outs)
        assert all(len(o.token_ids) == (1 if o.prompt_index == 0 else 24)
                   for o in outs if o.finish_reason == "length")
        assert any(o.finish_reason == "abort" for o in outs)
        assert _whole(engine), f"call {call}"


def test_abort_all_returns_every_sample_with_the_tokens_it_had(tiny_dirs, overlap, reference):
    """A caller with enough samples ends the rest (dynamic sampling, partial rollouts): every
    unfinished request comes back from its call at once, finish_reason "abort", its tokens and
    logprobs a prefix of what the same seeded call returns when it runs to the end; nothing is
    left behind."""
    engine = _engine(tiny_dirs, overlap)
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1, ignore_eos=True)
    params = [SamplingParams(max_new_tokens=1, seed=1)] + [sp] * (len(PROMPTS) - 1)
    full = {o.prompt_index: o for o in engine.generate(PROMPTS, params)}
    outs, ended = [], None
    for out in engine.generate_iter(PROMPTS, params):  # the one-token sample comes first
        outs.append(out)
        if ended is None:
            ended = engine.abort_all()  # between two steps, from the caller's own thread
    assert ended == len(PROMPTS) - 1
    assert sorted(o.prompt_index for o in outs) == list(range(len(PROMPTS)))
    for o in outs[1:]:
        assert o.finish_reason == "abort" and len(o.token_ids) < 24
        ref = full[o.prompt_index]
        assert o.token_ids == ref.token_ids[:len(o.token_ids)]
        assert o.logprobs == pytest.approx(ref.logprobs[:len(o.logprobs)], abs=1e-5)
    assert engine.abort_all() == 0  # nothing held between calls
    assert _whole(engine)
    assert _tokens(engine.generate(NEXT, SP)) == reference


def test_lost_kv_raises_instead_of_spinning_and_the_engine_recovers(tiny_dirs, overlap, reference):
    engine = _engine(tiny_dirs, overlap)
    alloc = engine.scheduler.alloc
    alloc._take(alloc.capacity - 2)  # slots no request records: lost
    with _fails_within(20), pytest.raises(KVCacheBudgetError, match="cannot be admitted"):
        engine.generate(NEXT, SP)
    assert _whole(engine)  # the pool was made whole again
    assert _tokens(engine.generate(NEXT, SP)) == reference


def test_a_pause_that_fails_does_not_leave_generation_paused(tiny_dirs, overlap, reference):
    engine = _engine(tiny_dirs, overlap)
    drain = engine.scheduler.drain

    def failing_drain():
        raise RuntimeError("injected drain failure")

    engine.scheduler.drain = failing_drain
    with pytest.raises(RuntimeError, match="injected drain failure"):
        engine.update_weights_from_tensor(list(hf_model(tiny_dirs[ARCH]).named_parameters()))
    engine.scheduler.drain = drain
    assert not engine.gate.paused
    assert _tokens(engine.generate(NEXT, SP)) == reference


def test_a_bad_update_does_not_touch_requests_in_flight(tiny_dirs):
    """Validation runs before the pause: with pause_mode="abort" a malformed update would
    otherwise end every in-flight request."""
    engine = _engine(tiny_dirs, True, pause_mode="abort")
    trainer = hf_model(tiny_dirs[ARCH])
    bad = [(n, p.detach()[..., :-1] if n == "model.norm.weight" else p.detach())
           for n, p in trainer.named_parameters()]
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    errors, outs = [], []

    def update_when_running():
        while engine.stats.steps < 3:
            pass
        try:
            engine.update_weights_from_tensor(bad)
        except WeightUpdateError as e:
            errors.append(e)

    worker = threading.Thread(target=update_when_running)
    worker.start()
    outs = engine.generate(PROMPTS * 4, sp)
    worker.join(timeout=60)
    assert errors and "has shape" in str(errors[0])
    assert all(o.finish_reason == "length" and len(o.token_ids) == 32 for o in outs)
    assert engine.weight_version == 0


def test_an_unexpected_error_mid_broadcast_leaves_the_engine_refusing(tiny_dirs, monkeypatch):
    """Not only the typed failures (a trainer that died): any error after the first write leaves
    a mix of versions, so the update fails typed and the engine refuses until a full update."""
    from weight_sync.bucket import UpdateManifest, pack_buckets
    engine = _engine(tiny_dirs, False)
    trainer = hf_model(tiny_dirs[ARCH])
    perturb(trainer, seed=5)
    buckets = pack_buckets(list(trainer.named_parameters()), bucket_bytes=64 << 10)
    assert len(buckets) > 2

    class FakeGroup:  # hands the buckets over as a broadcast would
        def __init__(self):
            self.i = 0

        def broadcast_async(self, flat, src):
            flat.copy_(buckets[self.i].flat)
            self.i += 1
            return type("Done", (), {"wait": lambda _self, f=flat: f})()

    load, calls = engine.runner.load_weights, []

    def failing_load(weights):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected allocation failure")
        return load(weights)

    engine.updater.group = FakeGroup()
    monkeypatch.setattr(engine.runner, "load_weights", failing_load)
    with pytest.raises(WeightUpdateError, match="stopped at bucket 2/.*injected allocation failure"):
        engine.update_weights_from_distributed(UpdateManifest([b.meta for b in buckets]))
    with pytest.raises(Exception, match="incomplete"):
        engine.generate(NEXT, SP)
    monkeypatch.setattr(engine.runner, "load_weights", load)
    engine.updater.group = None
    engine.update_weights_from_tensor(list(trainer.named_parameters()))
    assert engine.generate(NEXT, SP)[0].token_weight_versions == [1] * 6


def test_a_call_arriving_while_an_update_loads_waits_for_it(tiny_dirs, monkeypatch):
    """An update that is loading is a moment, not a fault: a generate that arrives then waits
    and runs on the new weights (it was refused with "a weight update is in progress")."""
    import time as _time
    engine = _engine(tiny_dirs, True)
    trainer = hf_model(tiny_dirs[ARCH])
    perturb(trainer, seed=8)
    load = engine.runner.load_weights

    def slow_load(weights):
        _time.sleep(1.0)
        return load(weights)

    monkeypatch.setattr(engine.runner, "load_weights", slow_load)
    update = threading.Thread(target=lambda: engine.update_weights_from_tensor(
        list(trainer.named_parameters())))
    update.start()
    deadline = _time.monotonic() + 30
    while not engine.updater.loading:
        assert _time.monotonic() < deadline
        _time.sleep(0.01)
    with _fails_within(60):
        out = engine.generate(NEXT, SP)[0]
    update.join(timeout=30)
    assert out.token_weight_versions == [1] * 6
