"""Spec: `Engine.score` — log p(token i | tokens before it) under softmax(logits / T) over the full
vocabulary, for given sequences (rollout/scoring.py).

Oracles: HF `transformers` on the same weights (log_softmax of its logits / T), and the engine's
own sampled logprobs (scoring a sample's prompt + tokens from the prompt's end gives its
`logprobs`). Ragged sequences, several in a step and one longer than a step (scored in pieces
after its own earlier KV), per-sequence starts, string sequences; bad arguments are refused
before any work, and the engine keeps serving with its pool whole."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import Engine, EngineConfig, InvalidRequestError, SamplingParams
from rollout.scoring import plan_steps
from tests.helpers import gpu, hf_model, kv_pool_whole

ARCH = "Qwen2ForCausalLM"
SEQS = [[3, 14, 15, 92, 65, 35], [46, 7], [(7 * j) % 500 + 1 for j in range(41)], [69, 39, 9]]


@pytest.fixture(scope="module")
def engine(tiny_dirs) -> Engine:
    # a 16-token step: the 41-token sequence goes in three pieces, the short ones share steps
    return Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=1024, max_prefill_tokens=16))


def _hf_logprobs(model, seq: list[int], start: int, temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    lp = (logits / temperature).log_softmax(-1)
    return [lp[i - 1, seq[i]].item() for i in range(start, len(seq))]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_are_hfs_log_softmax(tiny_dirs, engine, temperature):
    hf = hf_model(tiny_dirs[ARCH])
    starts = [1, 1, 5, 3]
    got = engine.score(SEQS, start=starts, temperature=temperature)
    for seq, s, lps in zip(SEQS, starts, got):
        assert len(lps) == len(seq) - s
        assert np.allclose(lps, _hf_logprobs(hf, seq, s, temperature), atol=1e-4, rtol=0)
    assert kv_pool_whole(engine.scheduler)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scoring_a_sample_gives_its_own_logprobs(engine, temperature):
    prompts = [SEQS[0], SEQS[1], SEQS[3]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=temperature,
                                                   seed=5, ignore_eos=True))
    scored = engine.score([o.prompt_token_ids + o.token_ids for o in outs],
                          start=[len(o.prompt_token_ids) for o in outs], temperature=temperature)
    for o, lps in zip(outs, scored):
        assert np.allclose(lps, o.logprobs, atol=1e-4, rtol=0)


@gpu
def test_gpu_scores_are_hfs_and_the_samplers(tiny_dirs):
    """The GPU path in float32: HF's log_softmax, and the fused sampler's logprobs of a sample."""
    engine = Engine(EngineConfig(model_path=tiny_dirs[ARCH], device="cuda", dtype="float32",
                                 kv_cache_tokens=1024, max_prefill_tokens=16))
    hf = hf_model(tiny_dirs[ARCH])
    for seq, lps in zip(SEQS, engine.score(SEQS, temperature=0.7)):
        assert np.allclose(lps, _hf_logprobs(hf, seq, 1, 0.7), atol=1e-3, rtol=0)
    outs = engine.generate(SEQS[:2], SamplingParams(max_new_tokens=20, seed=5, ignore_eos=True))
    scored = engine.score([o.prompt_token_ids + o.token_ids for o in outs],
                          start=[len(o.prompt_token_ids) for o in outs])
    for o, lps in zip(outs, scored):
        assert np.allclose(lps, o.logprobs, atol=1e-3, rtol=0)
    assert kv_pool_whole(engine.scheduler)


def test_string_sequences_and_a_start_at_the_end(tiny_dirs):
    engine = Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=1024))
    text = "hello world"
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 2 and engine.score([text], start=2) == engine.score([ids], start=2)
    assert engine.score([ids], start=len(ids)) == [[]]


@pytest.mark.parametrize("bad, message", [
    (dict(sequences=[]), "empty"),
    (dict(sequences=[[1, 2], []]), "prompt 1 is empty"),
    (dict(sequences=[[1, 10 ** 6]]), "outside"),
    (dict(sequences=[[1, 2, 3]], start=0), r"in \[1, 3\]"),
    (dict(sequences=[[1, 2, 3]], start=4), r"in \[1, 3\]"),
    (dict(sequences=[[1, 2, 3], [4, 5]], start=[1]), "one int per sequence"),
    (dict(sequences=[[1, 2, 3]], start=True), "int"),
    (dict(sequences=[[1, 2, 3]], temperature=0.0), "temperature"),
    (dict(sequences=[[1, 2, 3]], temperature=float("nan")), "temperature"),
])
def test_bad_arguments_are_refused_before_any_work(engine, bad, message):
    steps = engine.stats.steps
    args = {"start": 1, "temperature": 1.0, **bad}
    with pytest.raises(InvalidRequestError, match=message):
        engine.score(args.pop("sequences"), **args)
    assert engine.stats.steps == steps and kv_pool_whole(engine.scheduler)
    assert len(engine.score([[1, 2, 3]])[0]) == 2  # still serving


def test_steps_are_packed_in_order_and_pieces_follow_their_own_kv():
    steps = plan_steps([5, 40, 3, 3], budget=16, max_rows=2)
    flat = [(p.seq, p.begin, p.end) for step in steps for p in step]
    assert flat == [(0, 0, 5), (1, 0, 11), (1, 11, 27), (1, 27, 40), (2, 0, 3), (3, 0, 3)]
    assert [len(s) for s in steps] == [2, 1, 2, 1]  # a step of 16 tokens or 2 sequences at most
    assert all(sum(p.end - p.begin for p in s) <= 16 for s in steps)
