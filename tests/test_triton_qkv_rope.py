"""Spec: rollout/layers/triton_qkv_rope.py's fused one-row qkv + rotary + KV store writes bit for
bit what the plain skinny GEMV (same launch config) followed by the rotary kernel with its KV
store writes: the qkv output with q and k heads rotated, the rotated keys and the values at each
row's KV slot, and nothing else in the KV buffers.

On CPU the kernel runs under the Triton interpreter on tiny ragged shapes (K not a multiple of
the K chunk, one and several rows, with and without bias, one and two rotation pairs a program)
in fp32 and bf16. On a GPU (tests marked `gpu`): bf16 at Qwen2-1.5B's shapes with the engine's
launch config, eager and in a CUDA graph, and a two-layer model's decode logits with the fused
kernel equal those without it."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.layers import triton_gemv, triton_ops, triton_qkv_rope  # noqa: E402
from rollout.layers.triton_gemv import Config  # noqa: E402
from rollout.layers.triton_qkv_rope import QKVHeads, fused_config, qkv_rope  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402
from tests.test_fused_ops import rope  # noqa: E402

require_runnable_triton(triton_qkv_rope._qkv_rope_kernel)

SLOTS = 40


def rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEV, dtype=dtype)


def case(rows, heads: QKVHeads, k, dtype, bias: bool, seed=0):
    n = (heads.q + 2 * heads.kv) * heads.dim
    x = rand(rows, k, dtype=dtype, seed=seed)
    w = rand(n, k, dtype=dtype, seed=seed + 1, scale=k ** -0.5)
    b = rand(n, dtype=dtype, seed=seed + 2) if bias else None
    cos, sin = rope(rows, heads.dim, dtype, seed=seed + 3)
    loc = torch.randperm(SLOTS - 1, generator=torch.Generator().manual_seed(seed))[:rows] + 1
    return x, w, b, cos, sin, loc.to(DEV)


def kv_buffers(heads: QKVHeads, dtype):
    kb = rand(SLOTS, heads.kv, heads.dim, dtype=dtype, seed=11)
    vb = rand(SLOTS, heads.kv, heads.dim, dtype=dtype, seed=12)
    return kb, vb


def unfused(x, w, b, cos, sin, loc, heads: QKVHeads, config: Config, dtype):
    """The plain path: the GEMV, then the rotary kernel with its KV store (in place)."""
    qkv = triton_gemv.skinny_linear(x, w, b, config=config)
    rows = x.shape[0]
    qk = qkv[:, :(heads.q + heads.kv) * heads.dim].view(rows, heads.q + heads.kv, heads.dim)
    v = qkv[:, (heads.q + heads.kv) * heads.dim:].view(rows, heads.kv, heads.dim)
    kb, vb = kv_buffers(heads, dtype)
    triton_ops.apply_rotary_inplace(qk, cos, sin, kv=triton_ops.KVStore(v, loc, kb, vb))
    return qkv, kb, vb


def fused(x, w, b, cos, sin, loc, heads: QKVHeads, config: Config, dtype):
    kb, vb = kv_buffers(heads, dtype)
    out = qkv_rope(x, w, b, cos, sin, heads, triton_ops.KVStore(None, loc, kb, vb), config)
    return out, kb, vb


def assert_same(got, expected):
    for g, e, name in zip(got, expected, ("qkv", "k buffer", "v buffer")):
        assert g.dtype == e.dtype and torch.equal(g, e), (
            f"{name}: {(g != e).sum().item()} of {e.numel()} differ")


# ---- CPU (interpreter) and GPU: tiny ragged shapes --------------------------------------------
CONFIGS = {  # block_n = 2 · rotation pairs a program
    "one_pair": Config(2, 32, preload=2),
    "two_pairs_preload3": Config(4, 16, preload=3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("rows,k,bias", [(1, 48, True), (1, 64, False), (3, 40, True)])
def test_equals_gemv_then_rotary_with_kv_store(dtype, config, rows, k, bias):
    heads = QKVHeads(q=3, kv=2, dim=16)
    args = case(rows, heads, k, dtype, bias, seed=rows + k)
    cfg = CONFIGS[config]
    expected = unfused(*args, heads, cfg, dtype)
    assert_same(fused(*args, heads, cfg, dtype), expected)
    # the KV buffers changed at the rows' slots only (else this would check nothing)
    kb, vb = kv_buffers(heads, dtype)
    changed = (expected[1] != kb).flatten(1).any(1) | (expected[2] != vb).flatten(1).any(1)
    assert set(changed.nonzero().flatten().tolist()) == set(args[-1].tolist())


def test_fused_config_takes_unsplit_fma_configs_only(monkeypatch):
    heads = QKVHeads(q=12, kv=2, dim=128)
    x = torch.zeros(1, 1536, device=DEV, dtype=torch.bfloat16)
    w = torch.zeros(2048, 1536, device=DEV, dtype=torch.bfloat16)
    assert fused_config(x, w, heads) == triton_gemv._config(1, 2048, 1536)  # the engine's entry
    key = (1, 2048, 1536, False)
    for other in (Config(2, 512, 2), Config(3, 512), Config(256, 512), Config(16, 64, dot=True)):
        monkeypatch.setitem(triton_gemv._TUNED, key, other)
        assert fused_config(x, w, heads) is None, other  # split, odd, past a half, tensor cores
    monkeypatch.setitem(triton_gemv._TUNED, key, Config(2, 512))
    assert fused_config(x, w[:2000], heads) is None  # not this head layout
    monkeypatch.setattr(triton_qkv_rope, "FUSED_QKV_ROPE", False)
    assert fused_config(x, w, heads) is None


def test_bad_inputs_are_refused():
    heads = QKVHeads(q=3, kv=2, dim=16)
    x, w, b, cos, sin, loc = case(1, heads, 32, torch.float32, True)
    kb, vb = kv_buffers(heads, torch.float32)
    cfg = CONFIGS["one_pair"]
    before = (kb.clone(), vb.clone())
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_rope(x, w, b, cos[:, :, :4], sin, heads, triton_ops.KVStore(None, loc, kb, vb), cfg)
    with pytest.raises(ValueError, match="KV store"):
        qkv_rope(x, w, b, cos, sin, heads, triton_ops.KVStore(None, loc, kb[:, :1], vb), cfg)
    with pytest.raises(ValueError, match="bias"):
        qkv_rope(x, w, b[:-1], cos, sin, heads, triton_ops.KVStore(None, loc, kb, vb), cfg)
    with pytest.raises(ValueError, match="out"):
        qkv_rope(x, w, b, cos, sin, heads, triton_ops.KVStore(None, loc, kb, vb), cfg,
                 out=torch.empty(1, 7, device=DEV))
    assert torch.equal(kb, before[0]) and torch.equal(vb, before[1])  # nothing written


# ---- GPU: the engine's shapes and config -------------------------------------------------------
@gpu
def test_gpu_bf16_qwen2_shapes_eager_and_in_a_graph():
    heads = QKVHeads(q=12, kv=2, dim=128)
    x, w, b, cos, sin, loc = case(1, heads, 1536, torch.bfloat16, True, seed=5)
    cfg = fused_config(x, w, heads)
    assert cfg is not None
    expected = unfused(x, w, b, cos, sin, loc, heads, cfg, torch.bfloat16)
    assert_same(fused(x, w, b, cos, sin, loc, heads, cfg, torch.bfloat16), expected)
    kb, vb = kv_buffers(heads, torch.bfloat16)
    out = torch.empty(1, w.shape[0], device=DEV, dtype=torch.bfloat16)
    store = triton_ops.KVStore(None, loc, kb, vb)
    qkv_rope(x, w, b, cos, sin, heads, store, cfg, out)  # compile outside the capture
    kb.copy_(kv_buffers(heads, torch.bfloat16)[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv_rope(x, w, b, cos, sin, heads, store, cfg, out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_same((out, kb, vb), expected)


@gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_model_logits_equal_with_and_without_the_fused_kernel(tmp_path, monkeypatch, graph):
    """A model with Qwen2-1.5B's shapes (random bf16 weights, two layers, qkv bias): its one-row
    decode logits, eager and from the decode CUDA graph, are bit for bit those with the plain
    GEMV and the rotary kernel (ROLLOUT_FUSED_QKV_ROPE=0), and the fused kernel ran."""
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    from tests.test_split_sum import decode_logits
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    calls = []
    real = triton_qkv_rope.qkv_rope
    monkeypatch.setattr(triton_qkv_rope, "qkv_rope", lambda *a: calls.append(1) or real(*a))
    with_fused = decode_logits(path, 1, graph)
    assert calls, "the fused kernel never ran"
    monkeypatch.setattr(triton_qkv_rope, "FUSED_QKV_ROPE", False)
    assert torch.equal(with_fused, decode_logits(path, 1, graph))
