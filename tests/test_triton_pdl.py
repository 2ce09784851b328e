"""Spec for programmatic dependent launch (rollout/triton_pdl.py): on a Hopper-or-newer GPU our
Triton kernels launch with PDL by default, and a chain of them — each reading what the previous
one wrote, temporaries reused by the caching allocator — gives bit for bit the results of the
same chain launched without it, eagerly and inside a CUDA graph, with the next kernel triggered
after each wait or before it (rollout/pdl_policy.py; and a model's decode-graph logits with the
engine's trigger policy equal those with every trigger after the wait). Off the GPU (and under
the interpreter) PDL is off and the kernels take USE_PDL=False; the policy itself is checked on
CPU."""
import pytest
import torch

pytest.importorskip("triton")

from rollout import pdl_policy, triton_pdl  # noqa: E402
from rollout.forward_batch import ForwardMode  # noqa: E402
from tests.helpers import gpu  # noqa: E402


def test_off_without_a_hopper_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("a Hopper-or-newer GPU is present")
    assert not triton_pdl.enabled()
    assert triton_pdl.launch_options() == {"USE_PDL": False}


class _Batch:  # what pdl_policy.for_forward reads of a ForwardBatch
    def __init__(self, mode, batch_size):
        self.forward_mode, self.batch_size = mode, batch_size


def test_early_trigger_policy(monkeypatch):
    """"auto": early inside decode forwards, except the kernels that preload weights (unless
    inside preloaders_early); "1" / "0" everywhere / nowhere; other values are refused.
    launch_options turns it into the kernels' USE_PDL (when PDL is on)."""
    monkeypatch.delenv("ROLLOUT_PDL_EARLY_TRIGGER", raising=False)
    monkeypatch.setattr(triton_pdl, "_enabled", True)
    assert not pdl_policy.triggers_early()
    for mode, early in ((ForwardMode.DECODE, True), (ForwardMode.EXTEND, False),
                        (ForwardMode.MIXED, False)):
        for bs in (1, 128):
            with pdl_policy.for_forward(_Batch(mode, bs)):
                assert pdl_policy.triggers_early() == early, (mode, bs)
                assert not pdl_policy.triggers_early(preloads_weights=True)
                assert triton_pdl.launch_options()["USE_PDL"] == (2 if early else True)
                assert triton_pdl.launch_options(preloads_weights=True)["USE_PDL"] is True
                with pdl_policy.decode_forward(False):  # nested: restored on exit
                    assert not pdl_policy.triggers_early()
                assert pdl_policy.triggers_early() == early
                with pdl_policy.preloaders_early():  # the o projection: preloaders too
                    assert pdl_policy.triggers_early(preloads_weights=True) == early
                assert not pdl_policy.triggers_early(preloads_weights=True)
            assert not pdl_policy.triggers_early()
    monkeypatch.setenv("ROLLOUT_PDL_EARLY_TRIGGER", "1")
    assert pdl_policy.triggers_early() and pdl_policy.triggers_early(preloads_weights=True)
    monkeypatch.setenv("ROLLOUT_PDL_EARLY_TRIGGER", "0")
    with pdl_policy.decode_forward():
        assert not pdl_policy.triggers_early()
    monkeypatch.setenv("ROLLOUT_PDL_EARLY_TRIGGER", "light")
    with pytest.raises(ValueError, match="ROLLOUT_PDL_EARLY_TRIGGER"):
        triton_pdl.launch_options()
    monkeypatch.setattr(triton_pdl, "_enabled", False)
    assert triton_pdl.launch_options() == {"USE_PDL": False}


def _chain(x, res, norm_w, weights, cos, sin):
    from rollout.layers import triton_gemv, triton_ops
    for w in weights:
        h, res = triton_ops.fused_add_rms_norm(x, res, norm_w, 1e-6)
        y = triton_gemv.skinny_linear(h, w)  # [1, 2 * 256]
        triton_ops.apply_rotary_inplace(y.view(1, 4, 128), cos, sin)
        x = triton_ops.silu_and_mul(y)
    return x, res


@gpu
@pytest.mark.parametrize("early_trigger", [False, True])
def test_pdl_chain_equals_the_plain_chain_eager_and_in_a_graph(monkeypatch, early_trigger):
    """With the next kernel triggered after the wait, and (ROLLOUT_PDL_EARLY_TRIGGER=1) before it."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    assert triton_pdl.enabled()
    monkeypatch.setenv("ROLLOUT_PDL_EARLY_TRIGGER", "1" if early_trigger else "0")
    assert triton_pdl.launch_options()["USE_PDL"] == (2 if early_trigger else True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res = torch.randn(1, 256, generator=gen, **bf), torch.randn(1, 256, generator=gen, **bf)
    norm_w = torch.rand(256, generator=gen, **bf) + 0.5
    weights = [torch.randn(512, 256, generator=gen, **bf) / 16 for _ in range(24)]
    cos, sin = torch.rand(1, 1, 64, generator=gen, **bf), torch.rand(1, 1, 64, generator=gen, **bf)
    with_pdl = _chain(x, res, norm_w, weights, cos, sin)
    static = [t.clone() for t in (x, res)]
    graph = torch.cuda.CUDAGraph()
    _chain(*static, norm_w, weights, cos, sin)  # compiled before the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        graph_out = _chain(*static, norm_w, weights, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(triton_pdl, "_enabled", False)
    plain = _chain(x, res, norm_w, weights, cos, sin)
    for a, b, c in zip(with_pdl, graph_out, plain):
        assert torch.equal(a, c) and torch.equal(b, c)


@gpu
@pytest.mark.parametrize("rows", [1, 32, 128])
def test_gpu_model_logits_equal_with_the_early_trigger(tmp_path, monkeypatch, rows):
    """A model with Qwen2-1.5B's shapes (random bf16 weights, two layers): its decode logits from
    the decode CUDA graph with every kernel triggering its successor before its PDL wait
    (ROLLOUT_PDL_EARLY_TRIGGER=1), and with the engine's policy ("auto"), are bit for bit those
    with the trigger after the wait ("0")."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    from tests.test_split_sum import decode_logits
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    monkeypatch.setenv("ROLLOUT_PDL_EARLY_TRIGGER", "0")
    after_wait = decode_logits(path, rows, graph=True)
    for mode in ("1", "auto"):  # every launch early; the engine's policy
        monkeypatch.setenv("ROLLOUT_PDL_EARLY_TRIGGER", mode)
        assert torch.equal(decode_logits(path, rows, graph=True), after_wait), mode


@gpu
@pytest.mark.parametrize("step_graph_max_bs", [0, 16])
def test_gpu_engine_generates_the_same_with_and_without_pdl(tmp_path, monkeypatch,
                                                             step_graph_max_bs):
    """PDL changes when kernels start, never what they compute: an engine on a model with
    Qwen2-1.5B's shapes (random bf16 weights, two layers) generates the same tokens and logprobs
    with PDL as without it, over many decode steps of 1, 4 and 24 requests (the decode graphs
    and, up to 16 requests, the step graphs). A kernel that loaded before its PDL wait what an
    earlier kernel of its step writes would, at some steps, read the last step's value."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    calls = []
    for n in (1, 4, 24):
        prompts = [[3 + (11 * r + i) % 250 for i in range(4 + (5 * r) % 13)] for r in range(n)]
        params = [SamplingParams(max_new_tokens=40 + 9 * (r % 3), temperature=(1.0, 0.0, 0.7)[r % 3],
                                 seed=1000 * n + r) for r in range(n)]
        calls.append((prompts, params))

    def generate(pdl: bool):
        monkeypatch.setattr(triton_pdl, "_enabled", None if pdl else False)
        engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="bfloat16",
                                     cuda_graph_step_max_bs=step_graph_max_bs,
                                     cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 24, 32),
                                     max_running_requests=32, kv_cache_tokens=16384))
        assert triton_pdl.enabled() == pdl
        outs = [[(o.token_ids, o.logprobs) for o in engine.generate(*c)] for c in calls]
        engine.shutdown()
        return outs

    without = generate(False)
    assert generate(True) == without
