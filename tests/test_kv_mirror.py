"""Spec for the CPU decode KV mirror (rollout/attention/kv_mirror.py): batches from
DECODE_MATMUL_MIN_BATCH requests decode over a dense copy of their K/V that is appended while
the batch stays the same and rebuilt from the pool when it changes. Oracle: HF `generate` on the
same weights, and the gather path (mirror off) on the same engine."""
import pytest
import torch

import rollout.attention.kv_mirror as kv_mirror
from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention.torch_native import DECODE_MATMUL_MIN_BATCH
from tests.helpers import hf_model

ARCH = "Qwen2ForCausalLM"
BATCH = DECODE_MATMUL_MIN_BATCH + 8
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(1 + (5 * i) % 11)] for i in range(BATCH)]
MAX_NEW = [6 + (3 * i) % 13 for i in range(BATCH)]  # requests finish at different steps


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_ragged_batch_with_changing_members_equals_hf(tiny_dirs, engine):
    mirror = engine.runner.attn_backend.kv_mirror
    appended, rebuilt = mirror.appended_steps, mirror.rebuilt_steps
    outs = engine.generate(PROMPTS, [greedy(n) for n in MAX_NEW])
    assert mirror.appended_steps > appended  # the mirror served steps...
    assert mirror.rebuilt_steps - rebuilt >= 2  # ...and was rebuilt as requests left the batch
    hf = hf_model(tiny_dirs[ARCH])
    for prompt, n, out in zip(PROMPTS, MAX_NEW, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, return_dict_in_generate=True, output_logits=True)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        assert out.token_ids == ref_tokens
        ref_lp = torch.stack([torch.log_softmax(l[0].float(), -1)[t]
                              for l, t in zip(ref.logits, ref_tokens)])
        assert torch.allclose(torch.tensor(out.logprobs), ref_lp, atol=1e-5, rtol=0)


def test_mirror_matches_the_gather_path_when_sampling(engine, monkeypatch):
    sp = [SamplingParams(max_new_tokens=n, temperature=1.0, top_p=0.95, seed=i)
          for i, n in enumerate(MAX_NEW)]
    with_mirror = engine.generate(PROMPTS, sp)
    monkeypatch.setattr(kv_mirror, "MAX_MIRROR_BYTES", 0)  # every step gathers from the pool
    mirror = engine.runner.attn_backend.kv_mirror
    steps = mirror.appended_steps + mirror.rebuilt_steps
    gathered = engine.generate(PROMPTS, sp)
    assert mirror.appended_steps + mirror.rebuilt_steps == steps  # not used
    assert [o.token_ids for o in with_mirror] == [o.token_ids for o in gathered]
    for a, b in zip(with_mirror, gathered):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_retraction_under_a_tiny_pool_still_matches(tiny_dirs, engine):
    sp = greedy(24)
    big = engine.generate(PROMPTS, sp)
    small = Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=300))
    outs = small.generate(PROMPTS, sp)
    assert small.stats.retractions > 0
    assert small.runner.attn_backend.kv_mirror.appended_steps > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]
