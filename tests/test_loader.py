"""Spec: sharded index checkpoints load the same as single-file ones; tied and untied embeddings."""
import pytest
import torch

from rollout.tiny_model import TinyModelSpec, make_tiny_model
from tests.helpers import RunnerDriver, hf_last_logits, hf_model

PROMPTS = [[1, 2, 3, 4], [9, 8]]


def _state(driver):
    return {k: v.clone() for k, v in driver.runner.model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_equals_single_file(tmp_path, tied):
    spec = TinyModelSpec(architecture="LlamaForCausalLM", tie_word_embeddings=tied, seed=4)
    single = RunnerDriver(str(make_tiny_model(tmp_path / "one", spec)))
    sharded = RunnerDriver(str(make_tiny_model(tmp_path / "three", spec, num_shards=3)))
    assert (tmp_path / "three" / "model.safetensors.index.json").is_file()
    a, b = _state(single), _state(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(single.prefill(PROMPTS), sharded.prefill(PROMPTS))


@pytest.mark.parametrize("tied", [False, True])
def test_tied_and_untied_match_hf(tmp_path, tied):
    spec = TinyModelSpec(architecture="Qwen3ForCausalLM", tie_word_embeddings=tied, seed=2)
    path = str(make_tiny_model(tmp_path / "m", spec))
    driver, hf = RunnerDriver(path), hf_model(path)
    model = driver.runner.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    logits = driver.prefill(PROMPTS)
    expected = torch.stack([hf_last_logits(hf, p) for p in PROMPTS])
    assert (logits - expected).abs().max() <= 1e-4
