"""Spec: bad models, checkpoints and requests get typed errors that name the problem, raised
before any work starts; the engine keeps serving afterwards."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout import (CheckpointError, ConfigError, Engine, EngineConfig, InvalidRequestError,
                     KVCacheBudgetError, SamplingParams)
from rollout.tiny_model import TinyModelSpec, make_tiny_model


@pytest.fixture()
def model_dir(tmp_path):
    return make_tiny_model(tmp_path / "m", TinyModelSpec(max_position_embeddings=64))


def _engine(path, **kw):
    kw.setdefault("kv_cache_tokens", 512)
    return Engine(EngineConfig(model_path=str(path), **kw))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json not found"):
        _engine(model_dir)


def test_malformed_config(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        _engine(model_dir)


def test_config_missing_key(model_dir):
    _edit_config(model_dir, hidden_size=None)
    with pytest.raises(ConfigError, match="hidden_size"):
        _engine(model_dir)


def test_unknown_architecture(model_dir):
    _edit_config(model_dir, architectures=["MambaForCausalLM"])
    with pytest.raises(ConfigError, match="unknown architecture 'MambaForCausalLM'"):
        _engine(model_dir)


def test_missing_tensor(model_dir):
    _edit_weights(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing"):
        _engine(model_dir)


def test_extra_tensor(model_dir):
    _edit_weights(model_dir, lambda t: t.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unknown tensor 'model.layers.9.mlp.up_proj.weight'"):
        _engine(model_dir)


def test_misshaped_tensor(model_dir):
    _edit_weights(model_dir, lambda t: t.__setitem__("model.norm.weight", torch.ones(7)))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(7,\), expected \(64,\)"):
        _engine(model_dir)


def test_integer_tensor(model_dir):
    _edit_weights(model_dir, lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match="floating point"):
        _engine(model_dir)


def test_pickle_checkpoint_refused(model_dir):
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        _engine(model_dir)


def test_truncated_safetensors(model_dir):
    data = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _engine(model_dir)


def test_missing_shard(tmp_path):
    path = make_tiny_model(tmp_path / "s", TinyModelSpec(), num_shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        _engine(path)


def test_kv_budget_too_small(model_dir):
    with pytest.raises(KVCacheBudgetError, match="KV budget"):
        _engine(model_dir, kv_cache_tokens=1)


def test_bad_engine_config():
    with pytest.raises(ConfigError, match="tp_size"):
        EngineConfig(tp_size=0)
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="magic")
    with pytest.raises(ConfigError, match="preloaded_weights_bytes"):
        EngineConfig(preloaded_weights_bytes=-5)
    with pytest.raises(ConfigError, match="preloaded_weights_bytes"):
        EngineConfig(preloaded_weights_bytes=1.5)
    for bad in (0, -8, True, 2.5):
        with pytest.raises(ConfigError, match="max_prefill_tokens"):
            EngineConfig(max_prefill_tokens=bad)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("e") / "m", TinyModelSpec(max_position_embeddings=64))
    return _engine(path, kv_cache_tokens=48)


GOOD = SamplingParams(max_new_tokens=4, temperature=0.0)

BAD_CALLS = {
    "token id >= vocab": (lambda e: e.generate([[1, 512]], GOOD), InvalidRequestError, "token id 512"),
    "token id < 0": (lambda e: e.generate([[-1, 2]], GOOD), InvalidRequestError, "token id -1"),
    "empty prompt": (lambda e: e.generate([[]], GOOD), InvalidRequestError, "prompt 0 is empty"),
    "empty batch": (lambda e: e.generate([], GOOD), InvalidRequestError, "prompts is empty"),
    "float token": (lambda e: e.generate([[1.5]], GOOD), InvalidRequestError, "token ids must be ints"),
    "prompt longer than context": (lambda e: e.generate([[1] * 64], GOOD), InvalidRequestError, "context length"),
    "prompt larger than KV": (lambda e: e.generate([[1] * 50], GOOD), KVCacheBudgetError, "KV cache holds 48"),
    "params count": (lambda e: e.generate([[1], [2]], [GOOD]), InvalidRequestError, "1 sampling params for 2"),
    "unknown keyword": (lambda e: e.generate([[1]], GOOD, temprature=1), InvalidRequestError, "temprature"),
    "unknown sampling field": (lambda e: e.generate([[1]], {"max_tokens": 3}), InvalidRequestError, "max_tokens"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_generate_call_then_engine_still_serves(engine, name):
    before = engine.generate([[5, 6, 7]], GOOD)[0].token_ids
    call, err, msg = BAD_CALLS[name]
    with pytest.raises(err, match=msg):
        call(engine)
    assert not engine.scheduler.has_work
    assert engine.generate([[5, 6, 7]], GOOD)[0].token_ids == before


BAD_PARAMS = {
    "max_new_tokens=0": dict(max_new_tokens=0),
    "max_new_tokens<0": dict(max_new_tokens=-3),
    "temperature<0": dict(temperature=-0.1),
    "temperature nan": dict(temperature=float("nan")),
    "top_p=0": dict(top_p=0.0),
    "top_p>1": dict(top_p=1.5),
    "top_k=0": dict(top_k=0),
    "top_k=-2": dict(top_k=-2),
    "min_p=1": dict(min_p=1.0),
    "min_p<0": dict(min_p=-0.1),
    "n=0": dict(n=0),
    "logprobs<0": dict(logprobs=-1),
    "unknown keyword": dict(tempreature=0.5),
}


@pytest.mark.parametrize("name", list(BAD_PARAMS))
def test_bad_sampling_params_are_value_errors(name):
    with pytest.raises(ValueError) as info:
        SamplingParams(**BAD_PARAMS[name])
    assert isinstance(info.value, InvalidRequestError)
    key = next(iter(BAD_PARAMS[name]))
    assert key in str(info.value)
