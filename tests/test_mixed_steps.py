"""Spec for mixed steps (`EngineConfig.mixed_steps`): an admission's prefill step also carries the
running requests' next tokens. It changes which step computes a token, never the token: oracles
are the same engine without mixed steps (tokens, finish reasons, logprobs within fp32 rounding
of another attention kernel) and HF `generate` (greedy). Continuous batching is forced by
running fewer requests at once than the call has, with ragged prompt and response lengths."""
import dataclasses

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.scheduler import SchedulerStats
from tests.helpers import hf_model, kv_pool_whole
from tests.test_generate import RAGGED
from tests.test_overlap_schedule import _assert_same as assert_same_samples
from tests.test_overlap_schedule import _mixed_params

ARCH = "Qwen2ForCausalLM"


def _engine(tiny_dirs, mixed: bool, overlap: bool = False, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], mixed_steps=mixed, overlap_schedule=overlap,
                               max_running_requests=kw.pop("max_running", 3), **kw))


def _assert_same(a, b):
    """Another attention kernel computes the running rows of a mixed step: fp32 rounding."""
    assert_same_samples(a, b, atol=1e-5)


def _assert_idle(engine):
    assert kv_pool_whole(engine.scheduler)


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_generate_what_waiting_steps_do(tiny_dirs, overlap):
    """Ragged lengths, greedy and sampled rows, stop tokens, top logprobs; three requests
    running of sixteen, so most admissions find others decoding: the same outputs in fewer
    steps, every decode token counted, nothing leaked."""
    prompts = [RAGGED[i % 8] for i in range(16)]
    plain = _engine(tiny_dirs, False, overlap)
    free = plain.generate(prompts, _mixed_params([[] for _ in prompts]))
    params = _mixed_params([o.token_ids[1:2] if i % 4 == 1 else [] for i, o in enumerate(free)])
    before = dataclasses.replace(plain.stats)
    ref = plain.generate(prompts, params)
    mixed = _engine(tiny_dirs, True, overlap)
    got = mixed.generate(prompts, params)
    _assert_same(ref, got)
    assert any(o.finish_reason == "stop" for o in got), "the stop-token path was not exercised"
    generated = sum(len(o.token_ids) for o in got)
    calls = {}
    for engine, start in ((plain, before), (mixed, SchedulerStats())):
        calls[engine] = {f.name: getattr(engine.stats, f.name) - getattr(start, f.name)
                         for f in dataclasses.fields(start)}
        # every row sampled is a token kept or, with overlap, one dropped after a stop
        s = calls[engine]
        assert len(prompts) + s["decode_tokens"] - s["dropped_rows"] == generated
        _assert_idle(engine)
    # admissions as rows free: the running requests' tokens rode along, in fewer steps
    assert calls[plain]["mixed_decode_tokens"] == 0 and calls[mixed]["mixed_decode_tokens"] >= 2 * 10
    assert calls[mixed]["steps"] < calls[plain]["steps"]


def test_mixed_steps_greedy_equals_hf_generate(tiny_dirs):
    hf = hf_model(tiny_dirs[ARCH])
    engine = _engine(tiny_dirs, True, max_running=2)
    lens = [5, 17, 2, 9, 12, 3, 8, 20]
    outs = engine.generate(RAGGED, [SamplingParams(max_new_tokens=n, temperature=0.0) for n in lens])
    for prompt, n, out in zip(RAGGED, lens, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    _assert_idle(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_with_shared_prompts_and_retraction(tiny_dirs, overlap):
    """Samples sharing their prompt's KV (n = 3) admitted beside running requests, in a pool so
    small that requests are retracted and admitted again: the outputs of waiting steps, and
    every slot and row back after the call."""
    prompts = [RAGGED[i % 8] * 3 for i in range(6)]
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5, n=3)
    ref = _engine(tiny_dirs, False, overlap, kv_cache_tokens=50, max_running=5).generate(prompts, sp)
    mixed = _engine(tiny_dirs, True, overlap, kv_cache_tokens=50, max_running=5)
    got = mixed.generate(prompts, sp)
    _assert_same(ref, got)
    s = mixed.stats
    assert s.retractions > 0 and s.shared_prompt_tokens > 0 and s.mixed_decode_tokens > 0
    _assert_idle(mixed)


def test_mixed_steps_config_is_a_bool(tiny_dirs):
    from rollout.errors import ConfigError
    with pytest.raises(ConfigError, match="mixed_steps must be a bool"):
        EngineConfig(model_path=tiny_dirs[ARCH], mixed_steps=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mixed_steps_through_prefill_graphs(tiny_dirs):
    """On the GPU path (Triton, decode and prefill graphs, overlap; float32): mixed admission
    steps replay prefill graphs with the running rows in them, and give the waiting steps'
    outputs."""
    prompts = [RAGGED[i % 8] * (1 + i % 3) for i in range(24)]
    params = _mixed_params([[] for _ in prompts])
    outs = {}
    for mixed in (False, True):
        engine = Engine(EngineConfig(model_path=tiny_dirs[ARCH], device="cuda", mixed_steps=mixed,
                                     max_running_requests=4, kv_cache_tokens=4096))
        replays = engine.runner.graph_runner.prefill.num_replays
        outs[mixed] = engine.generate(prompts, params)
        assert engine.runner.graph_runner.prefill.num_replays > replays
        assert (engine.stats.mixed_decode_tokens > 0) == mixed
        _assert_idle(engine)
    _assert_same(outs[False], outs[True])
