"""Spec for Engine.generate: HF-exact greedy tokens and logprobs, batch-invariant seeded
sampling, retraction under a tiny KV pool."""
import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from tests.conftest import ARCHS
from tests.helpers import hf_model

RAGGED = [[3, 14, 15], [92, 65, 35, 89, 79, 32, 38], [46], [26, 43, 38, 32, 79, 50, 28, 84, 19, 71],
          [69, 39], [93, 75, 10, 58, 20], [97, 49, 44, 59, 23, 7], [81, 64, 6, 28]]


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    return {a: Engine(EngineConfig(model_path=tiny_dirs[a], kv_cache_tokens=4096)) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate(tiny_dirs, engines, arch):
    hf = hf_model(tiny_dirs[arch])
    outs = engines[arch].generate(RAGGED, SamplingParams(max_new_tokens=32, temperature=0.0))
    for prompt, out in zip(RAGGED, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)
        ref_tokens = ref.sequences[0, len(prompt):].tolist()
        assert out.token_ids == ref_tokens
        ref_lp = torch.stack([torch.log_softmax(l[0].float(), -1)[t] for l, t in zip(ref.logits, ref_tokens)])
        assert torch.allclose(torch.tensor(out.logprobs), ref_lp, atol=1e-5, rtol=0)
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == ("length" if len(ref_tokens) == 32 else "stop")


def test_sampled_logprobs_are_under_temperature_scaled_softmax(tiny_dirs, engines):
    arch = "Qwen2ForCausalLM"
    hf = hf_model(tiny_dirs[arch])
    sp = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=20, seed=3, logprobs=3)
    out = engines[arch].generate([RAGGED[1]], sp)[0]
    seq = RAGGED[1] + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0, len(RAGGED[1]) - 1:-1].float()
    ref = torch.log_softmax(logits / 0.7, -1)
    got = torch.tensor(out.logprobs)
    assert torch.allclose(got, ref[torch.arange(6), torch.tensor(out.token_ids)], atol=1e-5)
    top_ids = [[t for t, _ in step] for step in out.top_logprobs]
    assert top_ids == ref.topk(3, -1).indices.tolist()


def test_seeded_sample_is_batch_invariant(engines):
    eng = engines["Qwen3ForCausalLM"]
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    alone = eng.generate([RAGGED[3]], sp)[0].token_ids
    others = [SamplingParams(max_new_tokens=24 + i % 5, temperature=0.8, seed=i) for i in range(31)]
    mixed = eng.generate([RAGGED[i % 8] for i in range(31)] + [RAGGED[3]], others + [sp])
    assert mixed[-1].token_ids == alone
    again = eng.generate([RAGGED[3]], sp)[0]
    assert again.token_ids == alone


def test_n_samples_are_distinct_and_reproducible(engines):
    eng = engines["LlamaForCausalLM"]
    sp = SamplingParams(max_new_tokens=12, n=4, seed=5)
    a, b = eng.generate([RAGGED[0]], sp), eng.generate([RAGGED[0]], sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert len({tuple(o.token_ids) for o in a}) == 4
    assert [o.sample_index for o in a] == [0, 1, 2, 3]


def test_tiny_kv_pool_retracts_and_still_matches(tiny_dirs, engines):
    arch = "Qwen2ForCausalLM"
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    big = engines[arch].generate(RAGGED, sp)
    small = Engine(EngineConfig(model_path=tiny_dirs[arch], kv_cache_tokens=100))
    outs = small.generate(RAGGED, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]
    assert all(len(o.token_ids) == 32 for o in outs)
    assert small.stats.retractions > 0
    assert sum(o.num_retractions for o in outs) == small.stats.retractions


def test_prefill_budget_defaults_and_chunked_prefill_matches(tiny_dirs, engines):
    """The prefill-token budget: explicit, else 8192 on a GPU and on CPU the power of two of
    tokens whose gate|up activation fits 4 MiB. A budget far below the batch's prompt tokens
    prefills it over several EXTEND steps with the same greedy tokens and logprobs."""
    from rollout.config import ModelConfig
    path = tiny_dirs["Qwen2ForCausalLM"]
    mc = ModelConfig.from_pretrained(path)
    cpu = EngineConfig(model_path=path).prefill_token_budget(mc)
    per_token = 2 * mc.intermediate_size * 4  # fp32 gate|up activation of one token
    assert cpu & (cpu - 1) == 0 and 128 <= cpu <= 8192
    assert cpu == 128 or cpu * per_token <= 4 << 20  # fits, unless at the floor
    assert cpu == 8192 or 2 * cpu * per_token > 4 << 20  # the largest that fits, unless capped
    assert EngineConfig(model_path=path, device="cuda").prefill_token_budget(mc) == 8192
    assert EngineConfig(model_path=path, max_prefill_tokens=5).prefill_token_budget(mc) == 5
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    one_chunk = engines["Qwen2ForCausalLM"].generate(RAGGED, sp)
    small = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096, max_prefill_tokens=8))
    steps = small.stats.steps
    chunked = small.generate(RAGGED, sp)
    assert small.stats.steps - steps == 6 + 5  # 6 EXTEND steps (38 prompt tokens, <= 8 a step or
    # one prompt alone), then 5 decode steps
    assert [o.token_ids for o in chunked] == [o.token_ids for o in one_chunk]
    for a, b in zip(chunked, one_chunk):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_stop_tokens_and_string_prompts(engines):
    eng = engines["Qwen2ForCausalLM"]
    greedy = eng.generate(["hello"], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    assert greedy.prompt_token_ids == list(b"hello")
    stop = greedy.token_ids[3]
    out = eng.generate(["hello"], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                 stop_token_ids=[stop]))[0]
    first = greedy.token_ids.index(stop)
    assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"
    assert isinstance(out.text, str)


def test_streaming_yields_every_sample_once(engines):
    eng = engines["Qwen2ForCausalLM"]
    sps = [SamplingParams(max_new_tokens=2 + 5 * i, seed=i, n=2) for i in range(4)]
    got = list(eng.generate_iter(RAGGED[:4], sps))
    assert sorted((o.prompt_index, o.sample_index) for o in got) == [(i, k) for i in range(4) for k in range(2)]
    assert [len(o.token_ids) for o in got] == sorted(len(o.token_ids) for o in got)  # finish order


def test_agenerate(engines):
    import asyncio
    eng = engines["Qwen2ForCausalLM"]
    sp = SamplingParams(max_new_tokens=5, seed=9)
    outs = asyncio.run(eng.agenerate(RAGGED[:2], sp))
    assert [o.token_ids for o in outs] == [o.token_ids for o in eng.generate(RAGGED[:2], sp)]
