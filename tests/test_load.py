"""Spec under load (CPU, tiny model): 10,000 short requests through a KV pool sized for about a
tenth of their tokens all complete, in order and correct, with retractions counted and memory
bounded; and a soak of 50 generate + weight-update cycles grows neither memory nor threads."""
from __future__ import annotations

import logging
import resource
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rollout import Engine, EngineConfig, SamplingParams
from rollout.tiny_model import default_tiny_model_dir

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

N = 10_000
PROMPT_LEN, NEW_TOKENS = 4, 4
KV_TOKENS = N * (PROMPT_LEN + NEW_TOKENS) // 10  # room for about 1/10 of the requests


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_10k_requests_through_a_tenth_sized_kv_pool():
    # many running requests, so the pool (not the row count) is what runs out and forces retraction
    engine = Engine(EngineConfig(kv_cache_tokens=KV_TOKENS, max_running_requests=2048))
    prompts = [[(7 * i) % 250 + 1, (13 * i) % 250 + 1, (17 * i) % 250 + 1, 3] for i in range(N)]
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, seed=i)
              for i in range(N)]
    engine.generate(prompts[:64], params[:64])  # warm-up: allocator, kernels, first-call caches
    rss_before, t0 = rss_mib(), time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds, rss_after = time.perf_counter() - t0, rss_mib()
    logger.warning("10k requests: %.1fs, RSS %.0f -> %.0f MiB (peak %.0f), %s", seconds, rss_before,
                   rss_after, peak_rss_mib(), engine.stats)

    assert [o.prompt_index for o in outs] == list(range(N))
    assert all(len(o.token_ids) == NEW_TOKENS and o.finish_reason == "length" for o in outs)
    assert engine.stats.retractions > 0
    assert sum(o.num_retractions for o in outs) == engine.stats.retractions
    assert rss_after - rss_before < 200, f"RSS grew {rss_after - rss_before:.0f} MiB"
    # retracted requests were recomputed exactly: the same samples as alone
    retracted = [i for i, o in enumerate(outs) if o.num_retractions][:8]
    kept = [i for i, o in enumerate(outs) if not o.num_retractions][:8]
    for i, alone in zip(retracted + kept, engine.generate([prompts[i] for i in retracted + kept],
                                                          [params[i] for i in retracted + kept])):
        assert alone.token_ids == outs[i].token_ids
        assert alone.logprobs == pytest.approx(outs[i].logprobs, abs=1e-5)


def test_soak_50_generate_and_update_cycles():
    engine = Engine(EngineConfig(kv_cache_tokens=4096))
    base = load_file(str(default_tiny_model_dir() / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    weights = [[(n, t + 0.01 * torch.randn(t.shape, generator=g)) for n, t in base.items()] for _ in range(2)]
    prompts = [[i % 250 + 1, 5, 6, 7] for i in range(32)]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    threads_before = threading.active_count()
    tokens, rss, threads = [], [], []
    for cycle in range(50):
        outs = engine.generate(prompts, sp)
        assert {o.weight_version for o in outs} == {cycle}
        tokens.append([o.token_ids for o in outs])
        assert engine.update_weights_from_tensor(weights[cycle % 2]) == cycle + 1
        rss.append(rss_mib())
        threads.append(threading.active_count())
    logger.warning("soak RSS MiB every 10 cycles: %s", [round(r) for r in rss[::10]])
    # the weights alternate between two versions: so do the samples
    assert all(tokens[k] == tokens[k - 2] for k in range(3, 50))
    assert tokens[1] != tokens[2]
    assert max(rss[5:]) - rss[5] < 50, f"RSS grew {max(rss[5:]) - rss[5]:.0f} MiB after warm-up"
    assert max(threads) <= threads_before, f"threads grew: {threads_before} -> {max(threads)}"  # others may end
