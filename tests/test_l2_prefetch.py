"""Spec for the decode step's L2 weight prefetch (rollout/l2_prefetch.py).

The plan: a layer's budget covers the o projection, then the same leading rows of the gate and
up halves, then the down projection's leading rows, in 16-byte units, never past a weight's end.
On the GPU (Hopper or newer): the prefetch kernel runs on any region sizes, eagerly and in a
CUDA graph; inserted into a PDL chain it leaves the chain's results bit for bit unchanged; and
the engine's greedy tokens and log-probabilities are the same with the prefetch on and off,
with the prefetch launched once per layer in every decode step and never in a prefill."""
import pytest
import torch

pytest.importorskip("triton")

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.errors import ConfigError  # noqa: E402
from rollout import l2_prefetch  # noqa: E402
from rollout.l2_prefetch import LayerPrefetch, Region, plan  # noqa: E402
from tests.helpers import gpu  # noqa: E402


def _weights(device="cpu", dtype=torch.bfloat16):
    o = torch.zeros(64, 96, dtype=dtype, device=device)  # 12,288 B
    gate_up = torch.zeros(2 * 80, 64, dtype=dtype, device=device)  # halves of 10,240 B
    down = torch.zeros(64, 80, dtype=dtype, device=device)  # 10,240 B
    return o, gate_up, down


def _layer_plan(budget):
    o, gu, down = _weights()
    return plan([(o, 1), (gu, 2), (down, 1)], budget), (o, gu, down)


def test_plan_fills_o_then_both_gate_up_halves_then_down():
    regions, (o, gu, down) = _layer_plan(12_288 + 2 * 10_240 + 1_000)
    assert [(r.tensor is o, r.tensor is gu, r.tensor is down) for r in regions] == [
        (True, False, False), (False, True, False), (False, True, False), (False, False, True)]
    half = 80 * 64 * 2
    assert [(r.start, r.nbytes) for r in regions] == [(0, 12_288), (0, half), (half, half), (0, 992)]
    partial, _ = _layer_plan(12_288 + 2 * 4_000 + 1_000)  # gate/up: the same rows of both halves
    assert [(r.start, r.nbytes) for r in partial] == [(0, 12_288), (0, 4_496), (half, 4_496)]
    for r in regions + partial:
        assert r.start % 16 == 0 and r.nbytes % 16 == 0 and r.nbytes > 0
        assert r.start + r.nbytes <= r.tensor.numel() * r.tensor.element_size()


def test_plan_budget_bounds():
    assert _layer_plan(0)[0] == []
    assert _layer_plan(15)[0] == []
    small, (o, _, _) = _layer_plan(5_000)  # part of o only
    assert [(r.tensor is o, r.start, r.nbytes) for r in small] == [(True, 0, 4_992)]
    everything, (o, gu, down) = _layer_plan(10**9)  # whole weights, nothing past their ends
    assert [r.nbytes for r in everything] == [12_288, 10_240, 10_240, 10_240]
    assert sum(r.nbytes for r in everything) == sum(w.numel() * 2 for w in (o, gu, down))


def test_no_prefetch_off_the_gpu():
    o, gu, down = _weights()
    assert LayerPrefetch.for_layer(o, gu, down, 1 << 20) is None
    assert not l2_prefetch.supported(torch.device("cpu"))


def test_prefetch_launch_refuses_bad_region_counts():
    o = torch.zeros(16)
    with pytest.raises(ValueError, match="regions"):
        l2_prefetch.prefetch([])
    with pytest.raises(ValueError, match="regions"):
        l2_prefetch.prefetch([Region(o, 0, 16)] * (l2_prefetch.MAX_REGIONS + 1))


@pytest.mark.parametrize("bad", [-1, -0.5, True, "8", 1024, float("nan")])
def test_config_refuses_bad_budgets(bad):
    with pytest.raises(ConfigError, match="decode_l2_prefetch_mb"):
        EngineConfig(decode_l2_prefetch_mb=bad)


def test_config_budget_default_is_a_share_of_l2():
    from rollout.config import DEFAULT_L2_PREFETCH_FRACTION
    l2 = 50 << 20
    assert EngineConfig().l2_prefetch_bytes(l2) == int(DEFAULT_L2_PREFETCH_FRACTION * l2)
    assert EngineConfig(decode_l2_prefetch_mb=0).l2_prefetch_bytes(l2) == 0
    assert EngineConfig(decode_l2_prefetch_mb=1.5).l2_prefetch_bytes(l2) == 3 << 19


# ---- GPU ------------------------------------------------------------------------------------------
def _hopper():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")


@gpu
def test_prefetch_kernel_on_ragged_regions_eager_and_in_a_graph():
    _hopper()
    w = torch.randn(3001, 77, device="cuda", dtype=torch.bfloat16)  # 462,154 B: not a chunk multiple
    total = w.numel() * w.element_size() // 16 * 16
    regions = [Region(w, 0, 16), Region(w, 4096, total - 4096), Region(w, 32, 48),
               Region(w, 0, total)]
    before = w.clone()
    for n in range(1, len(regions) + 1):
        l2_prefetch.prefetch(regions[:n])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch.prefetch(regions)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)


@gpu
def test_prefetch_inside_a_pdl_chain_changes_nothing():
    """Each link reads what the previous one wrote; prefetch kernels between links (which
    launch their successor before they wait) must keep completion ordered."""
    _hopper()
    from rollout.layers import triton_gemv, triton_ops
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res = torch.randn(1, 256, generator=gen, **bf), torch.randn(1, 256, generator=gen, **bf)
    norm_w = torch.rand(256, generator=gen, **bf) + 0.5
    weights = [torch.randn(512, 256, generator=gen, **bf) / 16 for _ in range(24)]
    big = torch.randn(4 << 20, **bf)

    def chain(prefetch: bool):
        h, r = x, res
        for w in weights:
            h, r = triton_ops.fused_add_rms_norm(h, r, norm_w, 1e-6)
            if prefetch:
                l2_prefetch.prefetch([Region(big, 0, 8 << 20), Region(w, 0, w.numel() * 2)])
            h = triton_ops.silu_and_mul(triton_gemv.skinny_linear(h, w))
        return h, r

    plain = chain(False)
    assert all(torch.equal(a, b) for a, b in zip(chain(True), plain))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = chain(True)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, plain))


@gpu
def test_engine_same_greedy_outputs_with_and_without_prefetch(tiny_dirs):
    _hopper()
    prompts = [list(range(1, 1 + n)) for n in (3, 17, 40, 9, 64, 5, 31, 100)]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for mb in (0, 1):
        engine = Engine(EngineConfig(model_path=tiny_dirs["Qwen2ForCausalLM"], device="cuda",
                                     dtype="bfloat16", decode_l2_prefetch_mb=mb))
        layers = engine.runner.model.model.layers
        assert all((layer.self_attn.l2_prefetch is None) == (mb == 0) for layer in layers)
        replays = engine.runner.graph_runner.num_replays
        outs[mb] = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, sp)]
        assert engine.runner.graph_runner.num_replays - replays >= 15  # the graph path ran
        engine.shutdown()
    assert outs[0] == outs[1]


@gpu
def test_engine_prefetches_once_per_layer_in_each_decode_step_only(tiny_dirs, monkeypatch):
    _hopper()
    engine = Engine(EngineConfig(model_path=tiny_dirs["Qwen2ForCausalLM"], device="cuda",
                                 dtype="bfloat16", cuda_graph=False, overlap_schedule=False,
                                 decode_l2_prefetch_mb=1))
    calls = []
    monkeypatch.setattr(l2_prefetch, "prefetch", lambda regions: calls.append(len(regions)))
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert calls == []  # a prefill prefetches nothing: its GEMMs are compute-bound
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(calls) == 4 * engine.model_config.num_hidden_layers
    engine.shutdown()
