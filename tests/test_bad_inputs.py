"""Spec: the bad-input matrix. Every bad input to `generate`, `SamplingParams`, `EngineConfig`,
a checkpoint or a weight update gets a typed error whose message says what was wrong — and
afterwards the same engine serves a normal request with unchanged outputs (same tokens, same
logprobs, same weight version, nothing left queued, weights still complete)."""
from __future__ import annotations

import dataclasses
import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file

from rollout import (CheckpointError, ConfigError, Engine, EngineConfig, InvalidRequestError,
                     KVCacheBudgetError, SamplingParams, WeightUpdateError)
from rollout.tiny_model import TinyModelSpec, make_tiny_model, write_safetensors
from weight_sync.bucket import Bucket, UpdateManifest, pack_buckets, plan_buckets
from weight_sync.ipc import IpcExport
from weight_sync.spec import specs_of

SPEC = TinyModelSpec(max_position_embeddings=64)  # vocab 512, hidden 64, context 64
KV_TOKENS = 48
PROBE = [[5, 6, 7], [300, 20, 7, 9]]
PROBE_PARAMS = [SamplingParams(max_new_tokens=4, temperature=0.0),
                SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9, seed=11)]


@dataclass
class Ctx:
    engine: Engine
    model_dir: Path
    tmp: Path

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """A full, valid update that differs from the served weights (a partial write would show)."""
        g = torch.Generator().manual_seed(3)
        return [(n, t + 0.01 * torch.randn(t.shape, generator=g))
                for n, t in load_file(str(self.model_dir / "model.safetensors")).items()]

    def checkpoint(self, edit: Callable[[Path], Any] = lambda p: None, num_shards: int = 1) -> Path:
        out = self.tmp / "ckpt"
        out.mkdir()
        write_safetensors(out, dict(self.weights()), num_shards)
        edit(out)
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bad") / "m", SPEC, with_tokenizer=False)


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(EngineConfig(model_path=str(model_dir), kv_cache_tokens=KV_TOKENS, check_finite=True))


@pytest.fixture(scope="module")
def baseline(engine):
    return _settled_probe(engine)


def _probe(engine):
    """The probe's samples, and how much of them the prefix cache held: bit for bit the same
    whenever the weights and the cache are (a first probe fills the cache: `_settled_probe`)."""
    return [(o.token_ids, o.logprobs, o.weight_version, o.cached_tokens)
            for o in engine.generate(PROBE, PROBE_PARAMS)]


def _settled_probe(engine):
    _probe(engine)
    return _probe(engine)


# ---- helpers that build one bad input -----------------------------------------------------------
def _gen(prompts, params=PROBE_PARAMS[0], **kw):
    return lambda c: c.engine.generate(prompts, params, **kw)


def _sampling(**bad):
    """Passed the way users do (a dict to generate); SamplingParams itself raises the same."""
    def call(c):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
        c.engine.generate([[5, 6]], bad)
    return call


def _assigned_after_creation(**bad):
    """SamplingParams are plain dataclasses: a field set after creation is checked at generate."""
    def call(c):
        sp = SamplingParams(max_new_tokens=4)
        for name, value in bad.items():
            setattr(sp, name, value)
        c.engine.generate([[5, 6]], sp)
    return call


def _config(**bad):
    return lambda c: EngineConfig(model_path=str(c.model_dir), **bad)


def _disk(edit=lambda p: None, num_shards: int = 1):
    return lambda c: c.engine.update_weights_from_disk(c.checkpoint(edit, num_shards))


def _tensor(edit):
    return lambda c: c.engine.update_weights_from_tensor(edit(c.weights()))


def _replace(name: str, fn):
    return lambda w: [(n, fn(t) if n == name else t) for n, t in w]


def _poison(value: float):
    return lambda t: t.index_fill(0, torch.tensor([3]), value)


def _buckets(edit):
    def call(c):
        buckets = pack_buckets(c.weights(), bucket_bytes=64 << 10, with_checksum=True)
        return c.engine.update_weights_from_tensor(edit(buckets))
    return call


def _corrupt(buckets):
    buckets[1].flat[7] += 1.0  # a flipped value in transit
    return buckets


def _truncate(path: Path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _pickle_only(path: Path):
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": [1.0] * 64}))


def _pickle_named_safetensors(path: Path):
    (path / "model.safetensors").write_bytes(pickle.dumps({"model.norm.weight": [1.0] * 64}))


def _edit_tensors(fn):
    def edit(path: Path):
        tensors = load_file(str(path / "model.safetensors"))
        fn(tensors)
        write_safetensors(path, tensors)
    return edit


def _other_host_ipc(c):
    export = IpcExport(pack_buckets(c.weights())[0])
    try:
        handle = dataclasses.replace(export.handle, host="a-different-boot-id")
        c.engine.update_weights_from_ipc([handle])
    finally:
        export.close()


def _no_group(c):
    manifest = UpdateManifest(plan_buckets(specs_of(c.weights())))
    c.engine.update_weights_from_distributed(manifest)


NAN, INF = math.nan, math.inf
NORM = "model.norm.weight"
# name -> (the bad call, the error type, a regex its message must match)
CASES: dict[str, tuple[Callable[[Ctx], Any], type[Exception], str]] = {
    # generate(): prompts and call arguments
    "generate: token id >= vocab": (
        _gen([[1, 512]]), InvalidRequestError, r"prompt 0 has token id 512 outside \[0, 512\)"),
    "generate: negative token id": (_gen([[-1, 2]]), InvalidRequestError, "token id -1"),
    "generate: bad id in the 2nd prompt": (
        _gen([[1, 2], [3, 9999]]), InvalidRequestError, "prompt 1 has token id 9999"),
    "generate: token id past int64": (
        _gen([[1, 2**70]]), InvalidRequestError, f"prompt 0 has token id {2**70} outside"),
    # prompts are checked in order, each fully: the first bad prompt is named, whatever its fault
    "generate: bad id before a badly typed prompt": (
        _gen([[1, 2], [3, 9999], [1.5]]), InvalidRequestError, "prompt 1 has token id 9999"),
    "generate: prompt over the context before a bad id": (
        _gen([[1] * 64, [9999]]), InvalidRequestError, "prompt 0 has 64 tokens"),
    "generate: bad id before a prompt over the context": (
        _gen([[9999], [1] * 64]), InvalidRequestError, "prompt 0 has token id 9999"),
    "generate: float token id": (
        _gen([[1.5]]), InvalidRequestError, "holds 1.5; token ids must be ints"),
    "generate: bool token id": (_gen([[True, 2]]), InvalidRequestError, "token ids must be ints"),
    "generate: prompt is an int": (
        _gen([5]), InvalidRequestError, "prompt 0 must be a list of token ids or a string, got int"),
    "generate: prompts is a string": (_gen("hello"), InvalidRequestError, "prompts must be a list"),
    "generate: string prompt, no tokenizer": (
        _gen(["hello"]), InvalidRequestError, "no tokenizer.json"),
    "generate: empty batch": (_gen([]), InvalidRequestError, "prompts is empty"),
    "generate: empty prompt": (_gen([[]]), InvalidRequestError, "prompt 0 is empty"),
    "generate: prompt over the context": (
        _gen([[1] * 64]), InvalidRequestError, "64 tokens; the context length is 64"),
    "generate: prompt over the KV cache": (
        _gen([[1] * 50]), KVCacheBudgetError, "KV cache holds 48"),
    "generate: params count": (
        _gen([[1], [2]], [PROBE_PARAMS[0]]), InvalidRequestError, "1 sampling params for 2 prompts"),
    "generate: params of a wrong type": (
        _gen([[1]], 5), InvalidRequestError, "sampling_params must be SamplingParams"),
    "generate: prefill_logits of more prompts than request rows": (
        lambda c: c.engine.prefill_logits([[5]] * 300), KVCacheBudgetError, "300 prompts at once"),
    "generate: unknown keyword": (
        _gen([[1]], temprature=1.0), InvalidRequestError, "unknown generate.. argument.*temprature"),
    # SamplingParams
    "sampling: temperature NaN": (
        _sampling(temperature=NAN), InvalidRequestError, "temperature must be a finite number, got nan"),
    "sampling: temperature inf": (
        _sampling(temperature=INF), InvalidRequestError, "temperature must be a finite number, got inf"),
    "sampling: negative temperature": (
        _sampling(temperature=-0.5), InvalidRequestError, r"temperature must be 0 \(greedy\) or at least"),
    "sampling: temperature 0 in float32": (
        _sampling(temperature=1e-300), InvalidRequestError, "or at least 1e-05, got 1e-300"),
    "sampling: seed past 64 bits": (_sampling(seed=2**64), InvalidRequestError, r"seed must be an int in"),
    "sampling: logprobs over the vocabulary": (
        _gen([[5, 6]], SamplingParams(max_new_tokens=2, logprobs=600)), InvalidRequestError,
        "logprobs=600: the vocabulary has 512 tokens"),
    "sampling: field set after creation": (
        _assigned_after_creation(top_p=0.0), InvalidRequestError, r"top_p must be in \(0, 1\]"),
    "sampling: top_p -inf": (_sampling(top_p=-INF), InvalidRequestError, "top_p must be a finite number"),
    "sampling: top_p 0": (_sampling(top_p=0.0), InvalidRequestError, r"top_p must be in \(0, 1\]"),
    "sampling: min_p NaN": (_sampling(min_p=NAN), InvalidRequestError, "min_p must be a finite number"),
    "sampling: max_new_tokens 0": (
        _sampling(max_new_tokens=0), InvalidRequestError, "max_new_tokens must be an integer >= 1, got 0"),
    "sampling: max_new_tokens float": (
        _sampling(max_new_tokens=2.5), InvalidRequestError, "max_new_tokens must be an integer"),
    "sampling: top_k 0": (_sampling(top_k=0), InvalidRequestError, r"top_k must be -1 \(off\) or >= 1"),
    "sampling: n 0": (_sampling(n=0), InvalidRequestError, "n must be an integer >= 1"),
    "sampling: string seed": (_sampling(seed="7"), InvalidRequestError, "seed must be an int"),
    "sampling: negative stop id": (
        _sampling(stop_token_ids=[-1]), InvalidRequestError, "stop_token_ids must be non-negative"),
    "sampling: ignore_eos not bool": (
        _sampling(ignore_eos="yes"), InvalidRequestError, "ignore_eos must be a bool"),
    "sampling: unknown field": (
        _sampling(max_tokens=3), InvalidRequestError, r"unknown SamplingParams field\(s\) \['max_tokens'\]"),
    # EngineConfig
    "config: dtype": (_config(dtype="float8"), ConfigError, "dtype must be one of"),
    "config: device": (_config(device="tpu"), ConfigError, "device must be 'cpu', 'cuda' or 'cuda:N'"),
    "config: tp_size 0": (_config(tp_size=0), ConfigError, "tp_size must be a positive integer, got 0"),
    "config: negative kv_cache_tokens": (
        _config(kv_cache_tokens=-5), ConfigError, "kv_cache_tokens must be a positive integer"),
    "config: mem_fraction NaN": (
        _config(mem_fraction=NAN), ConfigError, r"mem_fraction must be a float in \(0, 1\]"),
    "config: max_running_requests bool": (
        _config(max_running_requests=True), ConfigError, "max_running_requests"),
    "config: pause_mode": (_config(pause_mode="later"), ConfigError, "pause_mode must be one of"),
    "config: load_format pickle": (
        _config(load_format="pt"), ConfigError, "load_format must be 'auto' or 'dummy'"),
    "config: graph batch size 0": (
        _config(cuda_graph_batch_sizes=(0, 8)), ConfigError, "cuda_graph_batch_sizes"),
    "config: prefill graph size True": (
        _config(cuda_graph_prefill_tokens=(True, 64)), ConfigError, "cuda_graph_prefill_tokens"),
    "config: no prefill graph request size": (
        _config(cuda_graph_prefill_requests=()), ConfigError, "cuda_graph_prefill_requests"),
    "config: prefill graph request size -4": (
        _config(cuda_graph_prefill_requests=(1, -4)), ConfigError, "cuda_graph_prefill_requests"),
    "config: no model directory": (
        lambda c: Engine(EngineConfig(model_path=str(c.tmp / "nope"))), ConfigError, "config.json not found"),
    "config: KV budget of 1 token": (
        lambda c: Engine(EngineConfig(model_path=str(c.model_dir), kv_cache_tokens=1)),
        KVCacheBudgetError, "KV budget holds 1"),
    # checkpoints (a weight update from disk; loading a new Engine from one)
    "checkpoint: truncated safetensors": (
        _disk(_truncate), WeightUpdateError, "model.safetensors is not a readable safetensors file"),
    "checkpoint: integer dtype": (
        _disk(_edit_tensors(lambda t: t.__setitem__(NORM, torch.ones(64, dtype=torch.int32)))),
        WeightUpdateError, "'model.norm.weight' has dtype torch.int32; weights must be floating point"),
    "checkpoint: missing shard": (
        _disk(lambda p: (p / "model-00002-of-00003.safetensors").unlink(), num_shards=3), WeightUpdateError,
        "shard model-00002-of-00003.safetensors named in model.safetensors.index.json is missing"),
    "checkpoint: malformed index": (
        _disk(lambda p: (p / "model.safetensors.index.json").write_text("{}"), num_shards=2),
        WeightUpdateError, "index.json is malformed"),
    "checkpoint: pickle file only": (
        _disk(_pickle_only), WeightUpdateError, "only pickle checkpoints .*pytorch_model.bin.*refused"),
    "checkpoint: pickle named .safetensors": (
        _disk(_pickle_named_safetensors), WeightUpdateError, "not a readable safetensors file"),
    "checkpoint: missing tensor": (
        _disk(_edit_tensors(lambda t: t.pop("lm_head.weight"))), WeightUpdateError,
        r"1 tensor\(s\) missing, e.g. \['lm_head.weight'\]"),
    "checkpoint: empty directory": (
        lambda c: c.engine.update_weights_from_disk(c.tmp), WeightUpdateError, "no model.safetensors"),
    "checkpoint: new Engine on a truncated file": (
        lambda c: Engine(EngineConfig(model_path=str(c.checkpoint(_truncate_with_config(c))))),
        CheckpointError, "not a readable safetensors file"),
    # weight updates
    "update: unknown name": (
        _tensor(lambda w: w + [("model.layers.7.mlp.up_proj.weight", torch.zeros(3))]), WeightUpdateError,
        "unknown tensor 'model.layers.7.mlp.up_proj.weight'"),
    "update: wrong shape": (
        _tensor(_replace(NORM, lambda t: t[:-1])), WeightUpdateError,
        r"'model.norm.weight' has shape \(63,\), expected \(64,\)"),
    "update: wrong dtype": (
        _tensor(_replace("lm_head.weight", lambda t: t.double())), WeightUpdateError,
        "'lm_head.weight' has dtype torch.float64, the engine holds torch.float32"),
    "update: NaN weight (check_finite)": (
        _tensor(_replace("model.layers.1.mlp.down_proj.weight", _poison(NAN))),
        WeightUpdateError, "'model.layers.1.mlp.down_proj.weight' holds NaN or inf"),
    "update: inf weight (check_finite)": (
        _tensor(_replace(NORM, _poison(INF))), WeightUpdateError,
        "'model.norm.weight' holds NaN or inf"),
    "update: missing tensors": (_tensor(lambda w: w[1:]), WeightUpdateError, r"tensor\(s\) missing"),
    "update: not a tensor": (
        _tensor(_replace(NORM, lambda t: t.tolist())), WeightUpdateError, "'model.norm.weight': list"),
    "update: not pairs": (
        lambda c: c.engine.update_weights_from_tensor([1, 2, 3]), WeightUpdateError,
        r"must be \(name, tensor\) pairs"),
    "update: bucket fails its checksum": (_buckets(_corrupt), WeightUpdateError, "failed its checksum"),
    "update: bucket shorter than its metadata": (
        _buckets(lambda b: [Bucket(b[0].meta, b[0].flat[:-1])] + b[1:]), WeightUpdateError,
        "bucket data is torch.float32 x .*, its metadata says"),
    "update: unknown pause_mode": (
        lambda c: c.engine.update_weights_from_tensor(c.weights(), pause_mode="later"), ConfigError,
        "pause_mode must be one of"),
    "update: broadcast without a group": (_no_group, WeightUpdateError, "no weight-sync group"),
    "update: float8 tensor": (
        _tensor(_replace(NORM, lambda t: t.to(torch.float8_e4m3fn))), WeightUpdateError,
        "'model.norm.weight' has dtype torch.float8_e4m3fn, which weight sync does not carry"),
    "update: version not an int": (
        lambda c: c.engine.update_weights_from_tensor(c.weights(), version="3"), WeightUpdateError,
        "version must be a non-negative int"),
    "update: negative version": (
        lambda c: c.engine.update_weights_from_tensor(c.weights(), version=-7), WeightUpdateError,
        "version must be a non-negative int"),
    "update: IPC handle from another host": (_other_host_ipc, WeightUpdateError, "another host"),
}


def _truncate_with_config(c: Ctx):
    def edit(path: Path):
        for name in ("config.json", "generation_config.json"):
            (path / name).write_text((c.model_dir / name).read_text())
        _truncate(path)
    return edit


def test_the_matrix_covers_every_category():
    kinds = {name.split(":")[0] for name in CASES}
    assert kinds == {"generate", "sampling", "config", "checkpoint", "update"}
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_typed_error_then_engine_unchanged(engine, baseline, model_dir, tmp_path, name):
    call, error, message = CASES[name]
    with pytest.raises(error, match=message):
        call(Ctx(engine, model_dir, tmp_path))
    assert engine.weight_version == 0 and engine.updater.incomplete_reason is None
    assert not engine.scheduler.has_work and not engine.scheduler.finished_pending
    assert _probe(engine) == baseline


def test_a_valid_update_does_change_outputs(engine, baseline, model_dir, tmp_path):
    """The control: the matrix's weights are a real change, so a partial write would have shown."""
    fresh = Engine(EngineConfig(model_path=str(model_dir), kv_cache_tokens=KV_TOKENS, check_finite=True))
    assert _settled_probe(fresh) == baseline
    fresh.update_weights_from_tensor(Ctx(fresh, model_dir, tmp_path).weights())
    assert [lp for _, lp, _, _ in _probe(fresh)] != [lp for _, lp, _, _ in baseline]


def test_config_json_errors_name_the_key(tmp_path):
    path = make_tiny_model(tmp_path / "m", SPEC, with_tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_key_value_heads"] = 3  # 4 heads are not a multiple of 3 KV heads
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        Engine(EngineConfig(model_path=str(path), kv_cache_tokens=64))
