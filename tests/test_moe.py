"""Spec for sparse mixture-of-experts models (Qwen3-MoE), with Hugging Face transformers on the
same random weights as the oracle (fp32): the config, the forward (a dense layer between sparse
ones), greedy generation and its logprobs, the expert kernels' two forms against a per-token
loop, and weight sync under both HF namings of the experts — a trainer's fused 3-D tensors and
a checkpoint's per-expert ones — against a fresh load, and through Ray into TP=2 shards (TP=2's
forward is in test_tp.py); the GPU path (CUDA graphs, bf16, no host sync)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout import Engine, EngineConfig, SamplingParams, WeightUpdateError
from rollout.config import ModelConfig
from rollout.errors import ConfigError
from rollout.layers import moe
from rollout.layers.moe import SparseMoE, moe_experts
from tests.conftest import MOE_ARCH
from tests.helpers import RunnerDriver, gpu, hf_last_logits, hf_model, sync_flags
from weight_sync import TRANSPORTS, WeightSender

PROMPTS = [[1, 5, 9], [42, 7, 300, 12, 8, 99, 3], [256, 17], list(range(60, 75))]


def test_config_names_the_sparse_layers(tiny_dirs, tmp_path):
    mc = ModelConfig.from_pretrained(tiny_dirs[MOE_ARCH])
    assert mc.moe.sparse_layers == {0, 2}  # mlp_only_layers=(1,)
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.intermediate_size) == (8, 2, 32)
    assert mc.moe.norm_topk_prob and mc.mlp_activation_width == 128
    raw = json.loads(Path(tiny_dirs[MOE_ARCH], "config.json").read_text())
    for bad, message in (({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
                         ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                         ({"moe_intermediate_size": 0}, "moe_intermediate_size=0")):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **bad}))
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "decoder_sparse_step": 2,
                                                      "mlp_only_layers": []}))
    assert ModelConfig.from_pretrained(tmp_path).moe.sparse_layers == {1}


def test_prefill_then_decode_match_hf(tiny_dirs):
    path = tiny_dirs[MOE_ARCH]
    hf, driver = hf_model(path), RunnerDriver(path)
    layers = driver.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [True, False, True]
    seqs = [list(p) for p in PROMPTS]
    logits, worst = driver.prefill(seqs), 0.0
    for step in range(13):
        expected = torch.stack([hf_last_logits(hf, s) for s in seqs])
        worst = max(worst, (logits - expected).abs().max().item())
        if step == 12:
            break
        nxt = expected.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = driver.decode(nxt)
    assert worst <= 1e-4, f"max |logit diff| {worst}"


def _per_token_loop(x, weights, experts, gate_up, down):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("grouped", [True, False])
def test_expert_forms_equal_a_per_token_loop(monkeypatch, grouped):
    """Both forms of `moe_experts` — grouped GEMMs over rows sorted by expert, and the gathered
    fallback — equal a loop over tokens, including experts no token picked and one every
    token picked."""
    if not grouped:  # the fallback, in chunks of 2 rows
        monkeypatch.setattr(moe, "_GROUPED_MM", None)
        monkeypatch.setattr(moe, "GATHER_BYTES", 2 * 3 * 8 * 16 * 4)
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, width, tokens = 6, 16, 8, 9
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * width, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, width, generator=gen)
    experts = torch.stack([torch.full((tokens,), 4), torch.randint(0, 3, (tokens,), generator=gen)], 1)
    weights = torch.rand(tokens, 2, generator=gen)
    got = moe_experts(x, weights, experts, gate_up, down)
    want = _per_token_loop(x, weights, experts, gate_up, down)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_generate_and_logprobs_match_hf(tiny_dirs):
    path = tiny_dirs[MOE_ARCH]
    hf = hf_model(path)
    engine = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                              min_new_tokens=10, output_logits=True, return_dict_in_generate=True)
        assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
        want = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(ref.logits, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(out.logprobs, want)) <= 1e-4
    engine.shutdown()


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


@torch.no_grad()
def _hf_logits(model) -> torch.Tensor:
    return torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_of_a_trainers_fused_experts_lands(tiny_dirs, tmp_path, transport):
    """A transformers trainer's `named_parameters()` holds the experts as fused 3-D tensors; a
    push lands them exactly (logits equal the trainer's), and equal a fresh engine loaded from
    the trainer's checkpoint, which holds them one tensor per expert."""
    path = tiny_dirs[MOE_ARCH]
    trainer = hf_model(path)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in trainer.named_parameters())
    engine = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096))
    sender = WeightSender(engine, transport, bucket_bytes=64 << 10, checksum=transport != "nccl",
                          sync_dir=str(tmp_path / "sync"))
    _perturb(trainer, seed=1)
    assert sender.push(trainer.named_parameters()) == 1
    pushed = engine.prefill_logits(PROMPTS)
    assert (pushed - _hf_logits(trainer)).abs().max() <= 1e-5
    sender.close()
    trainer.save_pretrained(tmp_path / "ckpt")
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in saved
    fresh = Engine(EngineConfig(model_path=str(tmp_path / "ckpt"), kv_cache_tokens=4096))
    assert torch.equal(fresh.prefill_logits(PROMPTS), pushed)
    for e in (engine, fresh):
        e.shutdown()


def test_per_expert_names_update_and_bad_updates_change_nothing(tiny_dirs, tmp_path):
    path = tiny_dirs[MOE_ARCH]
    trainer = hf_model(path)
    engine = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096))
    before = engine.prefill_logits(PROMPTS).clone()
    _perturb(trainer, seed=2)
    trainer.save_pretrained(tmp_path)
    per_expert = list(load_file(str(tmp_path / "model.safetensors")).items())
    fused = [(n, p.detach().clone()) for n, p in trainer.named_parameters()]
    up = "model.layers.2.mlp.experts.3.up_proj.weight"
    wrong_shape = [(n, t[:, :-1] if n.endswith("layers.0.mlp.experts.gate_up_proj") else t)
                   for n, t in fused]
    cases = [([(n, t) for n, t in per_expert if n != up], "missing"),
             (per_expert + [(up.replace(".3.", ".8."), torch.zeros(32, 64))],
              "unknown tensor 'model.layers.2.mlp.experts.8.up_proj.weight'"),
             (wrong_shape, r"'model.layers.0.mlp.experts.gate_up_proj' has shape \(8, 63, 64\), "
                           r"expected \(8, 64, 64\)")]
    for weights, message in cases:
        with pytest.raises(WeightUpdateError, match=message):
            engine.update_weights_from_tensor(weights)
        assert torch.equal(engine.prefill_logits(PROMPTS), before) and engine.weight_version == 0
    assert engine.update_weights_from_tensor(per_expert) == 1
    assert (engine.prefill_logits(PROMPTS) - _hf_logits(trainer)).abs().max() <= 1e-5
    engine.shutdown()


@gpu
def test_gpu_graphs_equal_hf_and_decode_never_syncs(tiny_dirs):
    """fp32 on the GPU path (CUDA graphs, overlap): greedy tokens equal HF's and the decode
    graphs ran; bf16 decode steps raise no host synchronisation (the grouped GEMMs and the
    routing on the device)."""
    path = tiny_dirs[MOE_ARCH]
    hf = hf_model(path)
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="float32",
                                 kv_cache_tokens=4096))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()
    assert engine.runner.graph_runner.num_replays >= 14
    engine.shutdown()
    bf16 = Engine(EngineConfig(model_path=path, device="cuda", dtype="bfloat16",
                               kv_cache_tokens=4096))

    def flags(new_tokens: int) -> int:
        return sync_flags(bf16, PROMPTS, SamplingParams(max_new_tokens=new_tokens,
                                                        ignore_eos=True, seed=3))

    short, long = flags(8), flags(40)  # the first measured call may carry a one-off flag
    assert long <= short, f"decode steps synchronised the host: {short} flags for 8 tokens, {long} for 40"
    bf16.shutdown()



@pytest.mark.ray
@pytest.mark.parametrize("transport", ["tensor", "nccl"])
def test_push_into_a_tp2_moe_replica(tiny_dirs, transport):
    """Through Ray into TP=2 shards: each rank narrows the trainer's fused experts to its share
    of every expert's width; the logits equal the trainer's."""
    from actors import RolloutController
    from tests.ray_helpers import local_ray
    path = tiny_dirs[MOE_ARCH]
    trainer = hf_model(path)
    with local_ray(num_cpus=4):
        cfg = EngineConfig(model_path=path, kv_cache_tokens=4096, tp_size=2)
        with RolloutController(cfg, num_replicas=1) as ctl:
            sender = WeightSender(ctl, transport, bucket_bytes=64 << 10)
            _perturb(trainer, seed=3)
            assert sender.push(trainer.named_parameters()) == 1
            assert (ctl.prefill_logits(PROMPTS, 0) - _hf_logits(trainer)).abs().max() <= 1e-5
            sender.close()


def _hf_routing(hf, seq: list[int]) -> torch.Tensor:
    """HF's experts for each token of `seq` in each sparse layer: [tokens, layers, top_k], sorted."""
    with torch.no_grad():
        logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
    k = hf.config.num_experts_per_tok
    return torch.stack([torch.topk(torch.softmax(x.float(), -1), k).indices for x in logits],
                       1).sort(-1).values


def _routing_is_hfs(hf, out) -> bool:
    seq = out.prompt_token_ids + out.token_ids[:-1]
    got = torch.from_numpy(out.routed_experts.astype("int64")).sort(-1).values
    return got.shape == (len(seq), 2, 2) and torch.equal(got, _hf_routing(hf, seq))


def test_routed_experts_are_hfs_routing_for_every_fed_token(tiny_dirs):
    """Routing replay: each output's `routed_experts` names, for every token it fed through the
    model (prompt, then outputs but the last) and every sparse layer, the experts HF routes that
    token to — also where the prompt's KV was a shared prompt's (n > 1), came from the prefix
    cache (a next turn), or was computed in a mixed step of continuous batching."""
    path = tiny_dirs[MOE_ARCH]
    hf = hf_model(path)
    engine = Engine(EngineConfig(model_path=path, kv_cache_tokens=4096, max_running_requests=3,
                                 record_routed_experts=True))
    first = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=1, n=2))
    turn = first[2].prompt_token_ids + first[2].token_ids + [17, 18]
    (second,) = engine.generate([turn], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert second.cached_tokens > 0
    for out in first + [second]:
        assert out.routed_experts.dtype == "int16" and _routing_is_hfs(hf, out)
    assert engine.stats.mixed_decode_tokens > 0  # some routing came from mixed steps
    engine.shutdown()


@gpu
def test_gpu_routing_record_equals_hf_through_graphs_without_syncs(tiny_dirs):
    """Routing replay on the GPU path: the routing kernel's ids scattered by slot inside the
    decode graphs (fp32: HF's routing for every fed token, graphs replayed), and recording adds
    no host synchronisation to bf16 decode steps (the readback is a pinned non-blocking copy)."""
    path = tiny_dirs[MOE_ARCH]
    hf = hf_model(path)
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="float32",
                                 kv_cache_tokens=4096, record_routed_experts=True))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=2, n=2))
    assert engine.runner.graph_runner.num_replays >= 14
    for out in outs:
        assert out.routed_experts.dtype == "int16" and _routing_is_hfs(hf, out)
    engine.shutdown()
    bf16 = Engine(EngineConfig(model_path=path, device="cuda", dtype="bfloat16",
                               kv_cache_tokens=4096, record_routed_experts=True))

    def flags(new_tokens: int) -> int:
        return sync_flags(bf16, PROMPTS, SamplingParams(max_new_tokens=new_tokens,
                                                        ignore_eos=True, seed=3))

    short, long = flags(8), flags(40)
    assert long <= short, f"decode steps synchronised the host: {short} flags for 8 tokens, {long} for 40"
    bf16.shutdown()


@gpu
def test_gpu_sorted_blocks_in_the_engine_equal_the_grouped_gemms(tiny_dirs, monkeypatch):
    """bf16 eager steps of 17-256 tokens through the sorted-blocks kernels (routing recorded by
    the routing kernel) give the grouped GEMMs' logits within bf16 rounding (routing recorded by
    a scatter), and the same routing where the inputs are the same."""
    from rollout.layers import triton_moe
    engine = Engine(EngineConfig(model_path=tiny_dirs[MOE_ARCH], device="cuda", dtype="bfloat16",
                                 kv_cache_tokens=4096, cuda_graph=False,
                                 record_routed_experts=True))
    params = SamplingParams(max_new_tokens=1, temperature=0.0)

    def run():
        logits = engine.prefill_logits(PROMPTS).float()
        routing = [o.routed_experts for o in engine.generate(PROMPTS, params)]
        return logits, routing

    assert 16 < sum(map(len, PROMPTS)) <= triton_moe.MAX_BLOCK_TOKENS
    blocks_logits, blocks_routing = run()
    monkeypatch.setattr(triton_moe, "MAX_BLOCK_TOKENS", 0)
    grouped_logits, grouped_routing = run()
    assert (blocks_logits - grouped_logits).abs().max() <= 0.02 * grouped_logits.abs().max()
    # the first sparse layer's input is the same bits on both paths, so its routing is too
    assert all((a[:, 0] == b[:, 0]).all() for a, b in zip(blocks_routing, grouped_routing))
    engine.shutdown()


def test_routing_is_recorded_only_when_asked_and_only_for_moe(tiny_dirs):
    engine = Engine(EngineConfig(model_path=tiny_dirs[MOE_ARCH], kv_cache_tokens=4096))
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))[0]
    assert out.routed_experts is None and engine.runner.token_to_kv_pool.routing is None
    with pytest.raises(ConfigError, match="record_routed_experts needs a mixture-of-experts"):
        Engine(EngineConfig(model_path=tiny_dirs["Qwen2ForCausalLM"], kv_cache_tokens=4096,
                            record_routed_experts=True))
    with pytest.raises(ConfigError, match="record_routed_experts must be a bool"):
        EngineConfig(record_routed_experts="yes")


@pytest.mark.ray
def test_routed_experts_through_a_tp2_replica(tiny_dirs):
    from actors import RolloutController
    from tests.ray_helpers import local_ray
    path = tiny_dirs[MOE_ARCH]
    with local_ray(num_cpus=4):
        cfg = EngineConfig(model_path=path, kv_cache_tokens=4096, tp_size=2,
                           record_routed_experts=True)
        with RolloutController(cfg, num_replicas=1) as ctl:
            outs = ctl.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=2))
    hf = hf_model(path)
    assert all(_routing_is_hfs(hf, out) for out in outs)
