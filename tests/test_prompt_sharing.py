"""Spec: the n samples of a prompt share its KV cache (rollout/prompt_group.py). Against the same
engine with `share_prompt_kv=False` (each sample prefills its prompt alone) and, greedy, HF's
`generate`: the same tokens, logprobs within fp32 rounding; the prompt computed once per group
(L + n - 1 prefill tokens for n samples of L tokens); every KV slot and row back in the pool
after the call — with and without overlap scheduling, under a KV pool so small that requests
are retracted and recomputed, when samples end at their first token, and when the weights
change before a sample joins its group; on the GPU path too (float32)."""
import numpy as np
import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.prompt_group import new_group
from tests.helpers import gpu, hf_model, kv_pool_whole

ARCH = "Qwen2ForCausalLM"
PROMPTS = [[3, 14, 15, 92, 65, 35], [46], [26, 43, 38, 32, 79, 50, 28, 84, 19, 71], [69, 39]]


def run(tiny_dirs, share: bool, sp: SamplingParams, prompts=PROMPTS, **cfg):
    cfg.setdefault("kv_cache_tokens", 4096)
    engine = Engine(EngineConfig(model_path=tiny_dirs[ARCH], share_prompt_kv=share, **cfg))
    return engine, engine.generate(prompts, sp)


def tokens(outs):
    return [(o.prompt_index, o.sample_index, o.token_ids) for o in outs]


def assert_pool_empty(engine: Engine) -> None:
    assert kv_pool_whole(engine.scheduler)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_samples_equal_samples_prefilled_alone(tiny_dirs, overlap, temperature):
    n = 4
    sp = SamplingParams(max_new_tokens=10, n=n, temperature=temperature, seed=11, ignore_eos=True,
                        logprobs=2)
    shared_engine, shared = run(tiny_dirs, True, sp, overlap_schedule=overlap)
    alone_engine, alone = run(tiny_dirs, False, sp, overlap_schedule=overlap)
    assert tokens(shared) == tokens(alone)
    for a, b in zip(shared, alone):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        assert [[t for t, _ in step] for step in a.top_logprobs] == \
            [[t for t, _ in step] for step in b.top_logprobs]
    stats = shared_engine.stats
    assert stats.prefill_tokens == sum(len(p) + n - 1 for p in PROMPTS)
    assert stats.shared_prompt_tokens == sum((n - 1) * (len(p) - 1) for p in PROMPTS)
    assert alone_engine.stats.prefill_tokens == n * sum(len(p) for p in PROMPTS)
    assert_pool_empty(shared_engine)
    if temperature == 0.0:  # the oracle: every sample is HF's greedy continuation
        hf = hf_model(tiny_dirs[ARCH])
        for out in shared:
            prompt = PROMPTS[out.prompt_index]
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
            assert out.token_ids == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_pool_retracts_group_members_and_still_matches(tiny_dirs, overlap):
    """A pool of 100 slots for 3 × 4 samples of up to 10 + 24 tokens: members are retracted,
    give their hold on the group's slots back, and are recomputed following the group again
    or leading it anew."""
    sp = SamplingParams(max_new_tokens=24, n=4, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:1] + PROMPTS[2:]
    _, alone = run(tiny_dirs, False, sp, prompts)
    small, shared = run(tiny_dirs, True, sp, prompts, kv_cache_tokens=100, overlap_schedule=overlap)
    assert tokens(shared) == tokens(alone)
    assert small.stats.retractions > 0 and small.stats.shared_prompt_tokens > 0
    assert_pool_empty(small)


def test_a_prompt_given_again_in_a_call_shares_too(tiny_dirs):
    """RL loops often repeat a prompt instead of asking for n: the samples of every copy of the
    same tokens in one call share one group, whatever their sampling parameters."""
    p, q = PROMPTS[0], PROMPTS[2]
    sps = [SamplingParams(max_new_tokens=5, n=2, seed=1, ignore_eos=True),
           SamplingParams(max_new_tokens=7, n=2, seed=2, ignore_eos=True),
           SamplingParams(max_new_tokens=9, temperature=0.5, seed=3, ignore_eos=True)]
    engine = Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096))
    shared = engine.generate([p, q, p], sps)
    alone = Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096,
                                share_prompt_kv=False)).generate([p, q, p], sps)
    assert tokens(shared) == tokens(alone)
    assert engine.stats.prefill_tokens == (len(p) + 2) + (len(q) + 1)  # p's 3 samples, q's 2
    assert engine.stats.shared_prompt_tokens == 2 * (len(p) - 1) + (len(q) - 1)
    assert_pool_empty(engine)


def test_followers_past_the_prefill_budget_join_in_a_later_step(tiny_dirs):
    """A prefill budget of the prompt's length: the leader's step holds its prompt alone, the
    followers come in the next step and take the group's held slots into their rows."""
    prompt, n = PROMPTS[2], 3
    sp = SamplingParams(max_new_tokens=6, n=n, temperature=1.0, seed=9, ignore_eos=True)
    engine, shared = run(tiny_dirs, True, sp, [prompt], max_prefill_tokens=len(prompt))
    _, alone = run(tiny_dirs, False, sp, [prompt])
    assert tokens(shared) == tokens(alone)
    assert engine.stats.prefill_tokens == len(prompt) + n - 1
    assert engine.stats.steps == 6 + 1  # the followers' step, then decodes of all three
    assert_pool_empty(engine)


def test_samples_of_one_token_share_in_one_step(tiny_dirs):
    """Followers join their leader's step: with max_new_tokens=1 the whole group prefills, and
    finishes, in one step."""
    n = 3
    sp = SamplingParams(max_new_tokens=1, n=n, temperature=1.0, seed=2)
    engine, shared = run(tiny_dirs, True, sp)
    _, alone = run(tiny_dirs, False, sp)
    assert tokens(shared) == tokens(alone)
    assert engine.stats.shared_prompt_tokens == sum((n - 1) * (len(p) - 1) for p in PROMPTS)
    assert engine.stats.steps == 1
    assert_pool_empty(engine)


def test_a_sample_joining_after_a_weight_update_prefills_alone(tiny_dirs):
    """Three requests may run: the leader and two followers take the first step; the leader is
    aborted, the weight version moves on (here without a weight change, so the tokens still
    equal the unshared run's), and the fourth sample is admitted: the group's KV, still held
    by the followers, was computed with the earlier weights, so it prefills its prompt alone;
    the followers' hold ends with them and every slot comes back."""
    prompt, n = PROMPTS[2], 4
    sp = SamplingParams(max_new_tokens=8, n=n, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model_path=tiny_dirs[ARCH], kv_cache_tokens=4096,
                                 max_running_requests=3))
    sched = engine.scheduler
    reqs = engine._requests.build([prompt], sp)
    for req in reqs:
        sched.add(req)
    sched.step()
    leader, *followers, last = reqs
    assert [r.shared_len for r in reqs] == [len(prompt) - 1] * 3 + [0] and last.row is None
    sched.abort(leader.rid)
    assert leader.group.holders == 2
    sched.weight_version += 1
    sched.step()
    # not the group's (nor the prefix cache's, emptied by the version change) KV
    assert not last.group_member and last.cached_tokens == 0 and last.row is not None
    assert sched.stats.prefill_tokens == len(prompt) + 2 + len(prompt)
    while sched.has_work:
        sched.step()
    _, alone = run(tiny_dirs, False, sp, [prompt])
    assert [r.output_ids for r in reqs[1:]] == [o.token_ids for o in alone[1:]]
    assert leader.group.vacant
    assert_pool_empty(engine)


def test_group_admission_and_hold():
    assert new_group(1, 4) is None and new_group(5, 1) is None
    group = new_group(5, 3)
    assert group.prefix_len == 4 and group.vacant
    assert group.admission_prefix(step=0, version=0) == 0  # leads
    group.reserve_lead(0, row=7)
    assert group.admission_prefix(0, 0) == 4  # follows row 7 in its step
    slots = np.array([7, 8, 9, 10])
    group.lead(slots, version=0)
    group.follow()
    assert group.admission_prefix(1, 0) == 4  # follows the held slots
    assert group.admission_prefix(1, 1) == 0  # other weights: alone
    assert group.leave() is None and not group.vacant  # one holder left
    assert group.leave() is slots and group.vacant  # the last one gives the slots back
    assert group.admission_prefix(2, 0) == 0


@gpu
def test_gpu_shared_samples_equal_samples_prefilled_alone(tiny_dirs):
    """On the GPU path (Triton attention, decode and prefill CUDA graphs, overlap) in float32:
    a follower admitted alone replays the one-request prefill graph after its cached prefix,
    several together run the eager extend; the tokens are those of samples prefilled alone."""
    for prompts, n in ((PROMPTS[2:3], 2), (PROMPTS, 4)):
        # one prompt: a prefill budget of its length puts the follower in the next step, alone
        cfg = dict(device="cuda", dtype="float32", kv_cache_tokens=4096,
                   max_prefill_tokens=len(prompts[0]) if n == 2 else None)
        sp = SamplingParams(max_new_tokens=12, n=n, temperature=1.0, seed=5, ignore_eos=True)
        shared_engine, shared = run(tiny_dirs, True, sp, prompts, **cfg)
        _, alone = run(tiny_dirs, False, sp, prompts, **cfg)
        assert tokens(shared) == tokens(alone)
        # a follower in a later step than its leader finds the prompt in the prefix cache
        stats = shared_engine.stats
        assert stats.shared_prompt_tokens + stats.cached_prompt_tokens == \
            sum((n - 1) * (len(p) - 1) for p in prompts)
        assert_pool_empty(shared_engine)
        if n == 2:  # the leader's prefill, then the follower's token: both one-request graphs
            assert shared_engine.runner.graph_runner.prefill.num_replays >= 2


def test_prompt_groups_of_a_call():
    """The same tokens → one group (sized by all their samples); other tokens of the same
    length, a lone sample, a one-token prompt → none shared with them."""
    from rollout.request_builder import prompt_groups
    arrays = [np.array(p, dtype=np.int64) for p in ([1, 2, 3], [1, 2, 4], [1, 2, 3], [5], [5])]
    one, two = SamplingParams(n=1), SamplingParams(n=2)
    groups = prompt_groups(arrays, [one, one, two, two, one])
    assert groups[0] is groups[2] and groups[0].prefix_len == 2
    assert groups[1] is None  # [1, 2, 4]: one sample
    assert groups[3] is None and groups[4] is None  # one token: nothing to share


@pytest.mark.parametrize("overlap", [False, True])
def test_random_mix_of_copies_samples_and_stops_in_a_tiny_pool(tiny_dirs, overlap):
    """24 prompts drawn from 5 (copies), 1-4 samples each, 1-12 new tokens, a stop token, in a
    pool of 150 slots (members retracted and recomputed, groups vacated and led anew): the
    tokens of the unshared engine with a large pool, and every slot back after the call."""
    rng = np.random.default_rng(4)
    base = [PROMPTS[0], PROMPTS[2], PROMPTS[3], [7, 7, 7, 7], PROMPTS[1]]
    prompts = [base[i] for i in rng.integers(0, len(base), 24)]
    sps = [SamplingParams(max_new_tokens=int(rng.integers(1, 13)), n=int(rng.integers(1, 5)),
                          temperature=1.0, seed=int(rng.integers(0, 1000)), stop_token_ids=(3,))
           for _ in prompts]
    small, shared = run(tiny_dirs, True, sps, prompts, kv_cache_tokens=150, overlap_schedule=overlap)
    _, alone = run(tiny_dirs, False, sps, prompts)
    assert tokens(shared) == tokens(alone)
    assert small.stats.retractions > 0 and small.stats.shared_prompt_tokens > 0
    assert_pool_empty(small)
