"""oneDNN-packed CPU weights: the results of the plain weights, and never read stale.

The oracle is an engine that never packs anything (packing off) holding the same weights. The
packed GEMMs are bit for bit the plain ones; the MLP's SiLU runs as a oneDNN post-op on the
packed path (an fp32 ulp or two from torch's), so logits agree within 1e-5 and greedy tokens
exactly — a stale packed copy (a 0.02-scale weight change) is off by orders of magnitude more."""
import pytest

from rollout import Engine, EngineConfig, SamplingParams
from tests.helpers import hf_model
from tests.test_weight_sync import hf_logits, perturb

PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 5)] for i in range(18)]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture()
def engines(tiny_dirs):
    path = tiny_dirs["Qwen2ForCausalLM"]
    packed = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096))
    plain = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096, cpu_packed_weights=False))
    return packed, plain, hf_model(path)


def _same(packed, plain) -> None:
    assert (packed.prefill_logits(PROMPTS) - plain.prefill_logits(PROMPTS)).abs().max() <= 1e-5
    got, want = packed.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(abs(a - b) for o, w in zip(got, want) for a, b in zip(o.logprobs, w.logprobs)) <= 1e-5
    assert len(packed.runner.model.packed_weights) > 0  # the packed path was taken
    assert len(plain.runner.model.packed_weights) == 0


def test_packed_weights_give_the_plain_results(engines):
    packed, plain, _ = engines
    _same(packed, plain)


def _tensor_update(engine, trainer):
    engine.update_weights_from_tensor([(n, p.detach().clone()) for n, p in trainer.named_parameters()])


def _disk_update(engine, trainer, tmp_path):
    trainer.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    engine.update_weights_from_disk(tmp_path / "ckpt")


@pytest.mark.parametrize("path", ["tensor", "disk", "import", "release-resume"])
def test_every_weight_write_drops_the_packed_copies(engines, path, tmp_path):
    packed, plain, trainer = engines
    _same(packed, plain)  # packed copies of the first weights exist now
    perturb(trainer, seed=3)
    if path == "tensor":
        _tensor_update(packed, trainer)
    elif path == "disk":
        _disk_update(packed, trainer, tmp_path)
    elif path == "import":
        _tensor_update(plain, trainer)  # a rebuilt shard catching up from a healthy one
        packed.runner.import_weights(plain.runner.export_weights())
    else:
        packed.release_memory()
        assert len(packed.runner.model.packed_weights) == 0
        packed.resume_memory()
        _tensor_update(packed, trainer)
    if path != "import":
        _tensor_update(plain, trainer)
    assert len(packed.runner.model.packed_weights) == 0
    _same(packed, plain)
    assert (packed.prefill_logits(PROMPTS[:3]) - hf_logits(trainer, PROMPTS[:3])).abs().max() <= 1e-5
