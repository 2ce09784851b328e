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

from rollout.layers import gemv_launch, triton_gemv, triton_ops, triton_qkv_rope  # noqa: E402
from rollout.layers.triton_gemv import Config  # noqa: E402
from rollout.layers.triton_qkv_rope import QKVHeads, fused_config, qkv_rope  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402
from tests.test_fused_ops import rope  # noqa: E402

require_runnable_triton(triton_qkv_rope._qkv_rope_kernel)

SLOTS = 160  # KV slots: more than the rows of any case


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


def assert_same(got, expected, atol: float = 0.0):
    """Bit for bit (atol 0), or within atol: the interpreter's fp32 tl.dot is numpy's matmul,
    whose summation order changes with the tile's shape (the fused TMA kernel's tiles are half
    as wide as the plain GEMM's); on a GPU the tensor cores sum each output alike."""
    for g, e, name in zip(got, expected, ("qkv", "k buffer", "v buffer")):
        ok = torch.equal(g, e) if atol == 0 else torch.allclose(g, e, rtol=0, atol=atol)
        assert g.dtype == e.dtype and ok, f"{name}: {(g != e).sum().item()} of {e.numel()} differ"


# ---- CPU (interpreter) and GPU: tiny ragged shapes --------------------------------------------
CONFIGS = {  # block_n = 2 · rotation pairs a program
    "one_pair": Config(2, 32, preload=2),
    "two_pairs_preload3": Config(4, 16, preload=3),
    # decode batches: TMA tiles of 16 rows, two weight tiles of 2 / 4 rows (K 40 / 48 against
    # chunks of 32: zero-filled past K; 17 rows: two M blocks, the second one row)
    "tma": Config(4, 32, dot=True, block_m=16, tma=True),
    "tma_wide": Config(8, 16, dot=True, num_stages=4, block_m=16, tma=True),
}
ROW_CASES = {"fma": [(1, 48, True), (1, 64, False), (3, 40, True)],
             "tma": [(3, 48, True), (17, 40, True), (5, 64, False)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config,rows,k,bias", [
    (c, *r) for c in CONFIGS for r in ROW_CASES["tma" if CONFIGS[c].tma else "fma"]])
def test_equals_gemv_then_rotary_with_kv_store(dtype, config, rows, k, bias):
    heads = QKVHeads(q=3, kv=2, dim=16)
    args = case(rows, heads, k, dtype, bias, seed=rows + k)
    cfg = CONFIGS[config]
    expected = unfused(*args, heads, cfg, dtype)
    interpreted_fp32_dot = cfg.tma and dtype == torch.float32 and DEV.type == "cpu"
    assert_same(fused(*args, heads, cfg, dtype), expected, atol=1e-5 if interpreted_fp32_dot else 0)
    # the KV buffers changed at the rows' slots only (else this would check nothing)
    kb, vb = kv_buffers(heads, dtype)
    changed = (expected[1] != kb).flatten(1).any(1) | (expected[2] != vb).flatten(1).any(1)
    assert set(changed.nonzero().flatten().tolist()) == set(args[-1].tolist())


def test_fused_config_takes_unsplit_fma_and_unswapped_tma_configs(monkeypatch):
    heads = QKVHeads(q=12, kv=2, dim=128)
    x = torch.zeros(1, 1536, device=DEV, dtype=torch.bfloat16)
    w = torch.zeros(2048, 1536, device=DEV, dtype=torch.bfloat16)
    assert fused_config(x, w, heads) == triton_gemv._config(1, 2048, 1536)  # the engine's entry
    batch = torch.zeros(32, 1536, device=DEV, dtype=torch.bfloat16)
    # what a GPU without the Gluon GEMM runs at 17-32 rows (here: no GPU): split, its sums in
    # the rotary kernel
    table = gemv_launch.GLUON_FALLBACK[(32, 2048, 1536, False)]
    assert table.tma and table.split_k == 2
    assert fused_config(batch, w, heads) is None  # forced unsplit it lost
    unsplit = table._replace(split_k=1)
    monkeypatch.setitem(triton_gemv._TUNED, (32, 2048, 1536, False), unsplit)
    assert fused_config(batch, w, heads) == unsplit
    monkeypatch.setitem(triton_gemv._TUNED, (32, 2048, 1536, False), unsplit._replace(swap_ab=True))
    assert fused_config(batch, w, heads) is None
    key = (1, 2048, 1536, False)
    for other in (Config(2, 512, 2), Config(3, 512), Config(256, 512), Config(16, 64, dot=True)):
        monkeypatch.setitem(triton_gemv._TUNED, key, other)
        assert fused_config(x, w, heads) is None, other  # split, odd, past a half, tensor cores
    monkeypatch.setitem(triton_gemv._TUNED, key, Config(2, 512))
    assert fused_config(x, w[:2000], heads) is None  # not this head layout
    monkeypatch.setitem(triton_gemv._TUNED, (32, 2048, 1536, False), unsplit)
    monkeypatch.setattr(triton_qkv_rope, "FUSED_QKV_ROPE", "one_row")
    assert fused_config(x, w, heads) is not None and fused_config(batch, w, heads) is None
    monkeypatch.setattr(triton_qkv_rope, "FUSED_QKV_ROPE", "0")
    assert fused_config(x, w, heads) is None


@pytest.mark.parametrize("rows,fused_fallback", [(32, False), (50, True), (100, True)])
def test_fused_config_never_takes_a_gluon_entry(monkeypatch, rows, fused_fallback):
    """At 17-128 rows the table names the Gluon GEMM (no rotary epilogue): where it runs, no
    fused config; where it cannot (here: no GPU), the TMA entry it replaced where that is
    unsplit (33-128 rows; at 17-32 it is split in 2, so the rotary kernel sums it)."""
    heads = QKVHeads(q=12, kv=2, dim=128)
    w = torch.zeros(2048, 1536, device=DEV, dtype=torch.bfloat16)
    batch = torch.zeros(rows, 1536, device=DEV, dtype=torch.bfloat16)
    key = triton_gemv._table_key(batch, w, False)
    assert triton_gemv._config(rows, 2048, 1536).gluon
    monkeypatch.setattr(triton_qkv_rope, "FUSED_QKV_ROPE", "1")
    monkeypatch.setattr(triton_gemv, "_gluon_runs", lambda device: False)
    assert fused_config(batch, w, heads) == (gemv_launch.GLUON_FALLBACK[key] if fused_fallback
                                             else None)
    monkeypatch.setattr(triton_gemv, "_gluon_runs", lambda device: True)
    assert fused_config(batch, w, heads) is None


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
@pytest.mark.parametrize("rows", [1, 2, 4, 32, 64, 128])
def test_gpu_bf16_qwen2_shapes_eager_and_in_a_graph(rows, monkeypatch):
    """The engine's configs (one row and small batches of 2-4: FMA; 32, 64 and 128: the TMA
    entries the Gluon GEMM replaced, unsplit), against the plain GEMM with the same config and
    the rotary kernel."""
    heads = QKVHeads(q=12, kv=2, dim=128)
    x, w, b, cos, sin, loc = case(rows, heads, 1536, torch.bfloat16, True, seed=5)
    key = (rows, 2048, 1536, False)
    table = gemv_launch.GLUON_FALLBACK.get(key) or triton_gemv._config(*key)
    monkeypatch.setitem(triton_gemv._TUNED, key, table._replace(split_k=1))
    cfg = fused_config(x, w, heads)
    assert cfg is not None and cfg.tma == (rows > 16)
    expected = unfused(x, w, b, cos, sin, loc, heads, cfg, torch.bfloat16)
    assert_same(fused(x, w, b, cos, sin, loc, heads, cfg, torch.bfloat16), expected)
    kb, vb = kv_buffers(heads, torch.bfloat16)
    out = torch.empty(rows, w.shape[0], device=DEV, dtype=torch.bfloat16)
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
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_model_logits_equal_with_and_without_the_fused_kernel(tmp_path, monkeypatch, graph,
                                                                  rows):
    """A model with Qwen2-1.5B's shapes (random bf16 weights, two layers, qkv bias): its decode
    logits at one row (FMA) and at 64 (TMA: the unsplit entry that the table's Gluon GEMM
    replaced, which GPUs without Gluon take), eager and from the decode CUDA graph, are bit for
    bit those with the plain GEMM and the rotary kernel (ROLLOUT_FUSED_QKV_ROPE=0), and the
    fused kernel ran at those rows."""
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    from tests.test_split_sum import decode_logits
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    key = (rows, 2048, 1536, False)
    if key in gemv_launch.GLUON_FALLBACK:
        monkeypatch.setitem(triton_gemv._TUNED, key, gemv_launch.GLUON_FALLBACK[key])
    calls = []
    real = triton_qkv_rope.qkv_rope
    monkeypatch.setattr(triton_qkv_rope, "qkv_rope",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with_fused = decode_logits(path, rows, graph)
    assert rows in calls, f"the fused kernel never ran at {rows} rows: {sorted(set(calls))}"
    monkeypatch.setattr(triton_qkv_rope, "FUSED_QKV_ROPE", "0")
    assert torch.equal(with_fused, decode_logits(path, rows, graph))
