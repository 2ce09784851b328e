"""Spec for releasing memory for a colocated trainer: `release_memory(tags=("kv_cache",
"weights"))` frees the KV pool and the weights (measured: storages and process RSS);
generating while released is a clear error; after `resume_memory` the KV cache serves at once,
while released weights are refused until a full weight update lands — then outputs are right.
The same on a RolloutController (TP=2: leaders and followers)."""
from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from actors import RolloutController
from rollout import ConfigError, Engine, EngineConfig, EngineNotReadyError, SamplingParams, WeightUpdateError
from rollout.tiny_model import default_tiny_model_dir
from tests.helpers import hf_model
from tests.ray_helpers import local_ray
from tests.test_load import rss_mib
from tests.test_weight_sync import PROMPTS, hf_logits, perturb

SP = [SamplingParams(max_new_tokens=6, temperature=0.0), SamplingParams(max_new_tokens=6, seed=5),
      SamplingParams(max_new_tokens=6, seed=6, top_k=20)]


def _weights() -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(default_tiny_model_dir() / "model.safetensors")).items())


def _outputs(target):
    return [(o.token_ids, o.logprobs) for o in target.generate(PROMPTS, SP)]


def _resident_bytes(engine, tag: str) -> int:
    return sum(t.untyped_storage().nbytes() for t in engine.runner._tensors_of(tag))


@pytest.fixture()
def engine():
    return Engine(EngineConfig(kv_cache_tokens=4096))


def test_release_both_then_resume_and_update(engine):
    before = _outputs(engine)
    weights_bytes, kv_bytes = _resident_bytes(engine, "weights"), _resident_bytes(engine, "kv_cache")
    engine.release_memory(tags=("kv_cache", "weights"))
    assert _resident_bytes(engine, "weights") == 0 and _resident_bytes(engine, "kv_cache") == 0
    with pytest.raises(EngineNotReadyError, match=r"released .*call resume_memory"):
        engine.generate(PROMPTS, SP)
    with pytest.raises(EngineNotReadyError, match="resume_memory"):
        engine.prefill_logits(PROMPTS)
    with pytest.raises(WeightUpdateError, match=r"weights are released .*resume_memory"):
        engine.update_weights_from_tensor(_weights())

    engine.resume_memory(tags=("kv_cache", "weights"))
    assert _resident_bytes(engine, "weights") == weights_bytes and _resident_bytes(engine, "kv_cache") == kv_bytes
    with pytest.raises(EngineNotReadyError, match="push a full weight update"):
        engine.generate(PROMPTS, SP)
    engine.update_weights_from_tensor(_weights()[:3], allow_partial=True)  # partial: still refused
    with pytest.raises(EngineNotReadyError, match="push a full weight update"):
        engine.generate(PROMPTS, SP)
    assert engine.update_weights_from_tensor(_weights()) == 2
    assert _outputs(engine) == before  # the same weights again: the same samples


def test_release_kv_only_serves_right_after_resume(engine):
    before = _outputs(engine)
    engine.release_memory(tags=("kv_cache",))
    engine.release_memory(tags=("kv_cache",))  # idempotent
    with pytest.raises(EngineNotReadyError, match=r"\['kv_cache'\] is released"):
        engine.generate(PROMPTS, SP)
    engine.resume_memory(tags=("kv_cache",))
    engine.resume_memory(tags=("kv_cache",))  # nothing left to resume: no-op
    assert _outputs(engine) == before and engine.weight_version == 0


def test_released_memory_leaves_the_process():
    # a freed 30 MiB block raises glibc's mmap threshold, so the pool's four ~24 MiB buffers
    # come from the heap, whose freed pages stay resident unless trimmed (CI saw RSS unchanged)
    torch.ones(30 * 2**20, dtype=torch.uint8).sum()
    engine = Engine(EngineConfig(kv_cache_tokens=200_000))  # ~98 MiB of KV on the tiny model
    freed = engine.runner.token_to_kv_pool.nbytes() / 2**20
    start = rss_mib()
    engine.release_memory()
    released = rss_mib()
    engine.resume_memory()
    # other threads of a long test process (Ray, gloo) allocate too: half the pool is the bound
    # (alone it measures ~100%; in the full suite 0.75 was seen)
    assert start - released > 0.5 * freed, f"RSS {start:.0f} -> {released:.0f} MiB, pool {freed:.0f} MiB"
    # resume zeroes the pool, so its pages come back; the allocator may hand out memory that
    # was already resident, hence the looser bound (a 0.8 bound failed once at 0.797)
    assert rss_mib() - released > 0.5 * freed


def test_bad_tags(engine):
    for tags in (("kv",), "weights", ("weights", "optimizer")):
        with pytest.raises(ConfigError, match="memory tags"):
            engine.release_memory(tags=tags)
    assert not engine.runner.released


def test_release_waits_for_a_running_generate(engine):
    prompts = [[i % 250 + 1, 2, 3] for i in range(64)]
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True, seed=1)
    result = {}
    worker = threading.Thread(target=lambda: result.update(outs=engine.generate(prompts, sp)))
    worker.start()
    while engine.stats.steps < 2:
        pass
    engine.release_memory()
    worker.join()
    assert all(len(o.token_ids) == 64 for o in result["outs"])
    assert engine.runner.released


@pytest.mark.ray
def test_controller_release_resume_tp2(tiny_dirs):
    path = tiny_dirs["LlamaForCausalLM"]
    trainer = hf_model(path)
    with local_ray(num_cpus=2), RolloutController(EngineConfig(model_path=path, kv_cache_tokens=4096, tp_size=2),
                                                   num_replicas=1) as ctl:
        ctl.release_memory(tags=("kv_cache", "weights"))
        assert all(s["released"] == ["kv_cache", "weights"] for s in ctl.status()[0]["shards"])
        with pytest.raises(EngineNotReadyError, match="resume_memory"):
            ctl.generate(PROMPTS, SP)
        with pytest.raises(WeightUpdateError, match="resume_memory"):
            ctl.update_weights_from_tensor(list(trainer.named_parameters()))
        ctl.resume_memory()
        assert all(s["released"] == [] for s in ctl.status()[0]["shards"])
        with pytest.raises(EngineNotReadyError, match="push a full weight update"):
            ctl.generate(PROMPTS, SP)
        perturb(trainer, seed=2)
        assert ctl.update_weights_from_tensor(list(trainer.named_parameters())) == 1
        assert (ctl.prefill_logits(PROMPTS) - hf_logits(trainer)).abs().max() <= 1e-5
        outs = ctl.generate(PROMPTS, SP)
        assert all(o.token_weight_versions == [1] * len(o.token_ids) for o in outs)


class _GraphRunnerStub:
    """Stands in for the CudaGraphRunner on CPU: records when graphs are dropped and captured."""

    def __init__(self):
        self.graphs, self.events = {1: object()}, []

    def can_run(self, fb) -> bool:
        return False

    def release(self) -> None:
        self.graphs.clear()
        self.events.append("release")

    def recapture(self) -> None:
        self.graphs[1] = object()
        self.events.append("capture")


def test_graphs_are_dropped_on_release_and_captured_once_everything_is_back(engine):
    engine.runner.graph_runner = stub = _GraphRunnerStub()
    engine.release_memory(tags=("kv_cache",))
    engine.release_memory(tags=("weights",))
    assert stub.events == ["release", "release"] and not stub.graphs
    engine.resume_memory(tags=("weights",))  # the KV cache is still out: no capture yet
    assert stub.events == ["release", "release"]
    engine.resume_memory(tags=("kv_cache",))
    assert stub.events[-1] == "capture" and stub.graphs
    kv = engine.runner.token_to_kv_pool.tensors()
    assert all(int(t.count_nonzero()) == 0 for t in kv)  # zeroed after the capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_release_resume_on_gpu_frees_memory_and_recaptures_graphs(tiny_dirs):
    path = tiny_dirs["Qwen2ForCausalLM"]
    engine = Engine(EngineConfig(model_path=path, device="cuda", kv_cache_tokens=1_000_000))
    graphs = engine.runner.graph_runner
    before = _outputs(engine)
    replays = graphs.num_replays
    assert replays > 0
    # a one-request prefill replays a prefill graph: its 40-token request row stays in the static
    # inputs, which the recapture on resume must not run the smaller graphs' warm-ups on
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    single = engine.generate([list(range(1, 41))], greedy)[0].token_ids
    assert graphs.prefill is not None and graphs.prefill.num_replays > 0
    kv_bytes = engine.runner.token_to_kv_pool.nbytes()
    free_before = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    assert torch.cuda.mem_get_info()[0] - free_before >= 0.9 * kv_bytes and not graphs.graphs
    engine.resume_memory()
    assert graphs.graphs
    engine.update_weights_from_tensor(list(load_file(f"{path}/model.safetensors").items()))
    after = _outputs(engine)
    assert [t for t, _ in after] == [t for t, _ in before]
    for (_, lp_after), (_, lp_before) in zip(after, before):
        assert lp_after == pytest.approx(lp_before, abs=1e-4)
    assert graphs.num_replays > replays
    assert engine.generate([list(range(1, 41))], greedy)[0].token_ids == single
