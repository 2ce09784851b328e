"""Spec: rollout/layers/triton_norm_qkv_rope.py's one-row add + RMSNorm + qkv + rotary + KV store
equals the engine's two kernels for it — `triton_ops.split_add_rms_norm` (or
`fused_add_rms_norm`) and then `triton_qkv_rope.qkv_rope` with the same weight rows a program:
the new residual bit for bit, and the qkv output and the KV cache within the rounding that the
mean of squares' summation order may flip (fp32 1e-5; bf16 a few elements by an ulp), nothing
written to the KV buffers but at the row's slot.

On CPU under the Triton interpreter (tiny shapes: one, two and three K chunks, split-K partials
and a plain branch output, with and without bias, one and two rotation pairs a program); on a GPU
(marked `gpu`) at Qwen2-1.5B's shapes, eager and inside a CUDA graph."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.layers import triton_gemv, triton_norm_qkv_rope, triton_ops  # noqa: E402
from rollout.layers.split_sum import SplitSum  # noqa: E402
from rollout.layers.triton_gemv import Config  # noqa: E402
from rollout.layers.triton_norm_qkv_rope import (NormQKVConfig, applies, norm_qkv,  # noqa: E402
                                                 norm_qkv_rope)
from rollout.layers.triton_qkv_rope import QKVHeads, qkv_rope  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402
from tests.test_triton_qkv_rope import SLOTS, kv_buffers, rand  # noqa: E402
from tests.test_fused_ops import rope  # noqa: E402

require_runnable_triton(triton_norm_qkv_rope._norm_qkv_rope_kernel)

EPS = 1e-6


def branch(k, dtype, split: int, seed: int):
    """A GEMM output of one row: fp32 split-K partials (a SplitSum) or a plain tensor."""
    if split == 1:
        return rand(1, k, dtype=dtype, seed=seed)
    partials = rand(split, 1, k, dtype=torch.float32, seed=seed)
    return SplitSum(partials, torch.empty(1, k, dtype=dtype, device=DEV))


def case(heads: QKVHeads, k, dtype, split, bias, seed=0):
    n = (heads.q + 2 * heads.kv) * heads.dim
    h = branch(k, dtype, split, seed)
    residual = rand(1, k, dtype=dtype, seed=seed + 1)
    norm_w = 1 + rand(k, dtype=dtype, seed=seed + 2, scale=0.1)
    w = rand(n, k, dtype=dtype, seed=seed + 3, scale=k ** -0.5)
    b = rand(n, dtype=dtype, seed=seed + 4) if bias else None
    cos, sin = rope(1, heads.dim, dtype, seed=seed + 5)
    loc = torch.tensor([seed % (SLOTS - 1) + 1], device=DEV)
    return h, residual, norm_w, w, b, cos, sin, loc


def unfused(h, residual, norm_w, w, b, cos, sin, loc, heads, cfg: NormQKVConfig, dtype):
    """The engine's two kernels: the add + norm, then qkv + rotary + KV store."""
    if isinstance(h, SplitSum):
        x, new_residual = triton_ops.split_add_rms_norm(h, residual, norm_w, EPS)
    else:
        x, new_residual = triton_ops.fused_add_rms_norm(h, residual, norm_w, EPS)
    block_k, chunks = triton_norm_qkv_rope.row_chunks(residual.shape[1])
    kb, vb = kv_buffers(heads, dtype)
    out = qkv_rope(x, w, b, cos, sin, heads, triton_ops.KVStore(None, loc, kb, vb),
                   Config(2 * cfg.pairs, block_k, preload=chunks))
    return new_residual, out, kb, vb


def fused(h, residual, norm_w, w, b, cos, sin, loc, heads, cfg: NormQKVConfig, dtype):
    kb, vb = kv_buffers(heads, dtype)
    out = torch.empty(1, w.shape[0], dtype=dtype, device=DEV)
    new_residual = norm_qkv_rope(h, residual, norm_w, EPS, w, b, cos, sin, heads,
                                 triton_ops.KVStore(None, loc, kb, vb), out, cfg)
    return new_residual, out, kb, vb


def assert_close(got, expected, dtype):
    assert torch.equal(got[0], expected[0]), "new residual"
    for g, e, name in zip(got[1:], expected[1:], ("qkv", "k buffer", "v buffer")):
        assert not g.isnan().any(), f"{name}: not every element written"
        if dtype == torch.float32:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=name)
        else:  # an element of the normed row may flip by an ulp, moving a few outputs by one
            differ = (g != e).sum().item()
            assert differ <= max(2, e.numel() // 50), f"{name}: {differ} of {e.numel()} differ"
            torch.testing.assert_close(g.float(), e.float(), rtol=2 ** -7, atol=2 ** -7,
                                       msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,split,bias,pairs", [
    (64, 2, True, 1),    # one K chunk, split-K partials
    (96, 1, False, 2),   # three chunks of 32, a plain branch output
    (128, 3, True, 2),   # two chunks of 64, three partials
    (48, 2, False, 1),   # three chunks of 16
])
def test_equals_add_norm_then_qkv_rope(dtype, k, split, bias, pairs):
    heads = QKVHeads(q=3, kv=2, dim=16)
    cfg = NormQKVConfig(pairs, 1)
    args = case(heads, k, dtype, split, bias, seed=k + split)
    expected = unfused(*args, heads, cfg, dtype)
    got = fused(*args, heads, cfg, dtype)
    assert_close(got, expected, dtype)
    # the KV buffers changed at the row's slot only (else this would check nothing)
    kb, vb = kv_buffers(heads, dtype)
    changed = (got[2] != kb).flatten(1).any(1) | (got[3] != vb).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == args[-1].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,split,bias,pairs", [
    (64, 2, False, 1),   # one K chunk, split-K partials
    (96, 1, True, 2),    # three chunks of 32, a plain branch output
    (128, 3, False, 4),  # two chunks of 64, three partials, a half's rows a program
])
def test_without_rotary_equals_add_norm_then_the_gemv(dtype, k, split, bias, pairs):
    """`norm_qkv` (Qwen3's fold: its q/k norms come before the rotary, in the kernel after):
    the new residual and qkv as the norm kernel and then the plain GEMV with the same rows a
    program write them, every column written, and nothing rotated or stored in the KV cache."""
    heads = QKVHeads(q=3, kv=2, dim=16)
    cfg = NormQKVConfig(pairs, 1)
    h, residual, norm_w, w, b, *_ = case(heads, k, dtype, split, bias, seed=k + pairs)
    if isinstance(h, SplitSum):
        x, expected_residual = triton_ops.split_add_rms_norm(h, residual, norm_w, EPS)
    else:
        x, expected_residual = triton_ops.fused_add_rms_norm(h, residual, norm_w, EPS)
    block_k, chunks = triton_norm_qkv_rope.row_chunks(k)
    expected = triton_gemv.skinny_linear(x, w, b, config=Config(2 * pairs, block_k,
                                                                preload=chunks))
    out = torch.full((1, w.shape[0]), float("nan"), dtype=dtype, device=DEV)
    new_residual = norm_qkv(h, residual, norm_w, EPS, w, b, heads, out, cfg)
    assert_close((new_residual, out), (expected_residual, expected), dtype)
    rotated = qkv_rope(x, w, b, *rope(1, heads.dim, dtype, seed=3), heads,
                       triton_ops.KVStore(None, torch.tensor([1], device=DEV),
                                          *kv_buffers(heads, dtype)),
                       Config(2 * pairs, block_k, preload=chunks))
    assert not torch.equal(rotated, out)  # the rotary would have changed q and k


def test_applies_only_where_the_kernel_can_hold_the_row():
    heads = QKVHeads(q=3, kv=2, dim=16)
    cfg = NormQKVConfig(2, 1)
    dt = torch.bfloat16
    h, residual, norm_w, w, *_ = case(heads, 96, dt, 2, False)
    assert applies(h, residual, norm_w, w, heads, cfg) == (DEV.type == "cuda")
    if DEV.type != "cuda":
        return
    assert not applies(h, residual, norm_w, w, heads, None)  # off
    assert not applies(h, residual, norm_w, w, heads, NormQKVConfig(16, 1))  # pairs past a half
    two_rows = torch.zeros(2, 96, dtype=dt, device=DEV)
    assert not applies(two_rows, two_rows, norm_w, w, heads, cfg)
    with_bias = SplitSum(h.partials, h.out, torch.zeros(96, dtype=dt, device=DEV))
    assert not applies(with_bias, residual, norm_w, w, heads, cfg)
    odd = torch.zeros(1, 80, dtype=dt, device=DEV)  # 80: no power-of-two chunks of it
    assert not applies(odd, odd, torch.ones(80, dtype=dt, device=DEV),
                       torch.zeros(w.shape[0], 80, dtype=dt, device=DEV), heads, cfg)


def test_bad_inputs_are_refused_before_the_launch():
    heads = QKVHeads(q=3, kv=2, dim=16)
    cfg = NormQKVConfig(1, 1)
    dt = torch.bfloat16
    h, residual, norm_w, w, b, cos, sin, loc = case(heads, 64, dt, 2, True)
    kb, vb = kv_buffers(heads, dt)
    kv = triton_ops.KVStore(None, loc, kb, vb)
    out = torch.zeros(1, w.shape[0], dtype=dt, device=DEV)
    bad = {"cos": (h, residual, norm_w, EPS, w, b, cos[:, :, :4].contiguous(), sin, heads, kv,
                   out, cfg),
           "out": (h, residual, norm_w, EPS, w, b, cos, sin, heads, kv, out[:, :-1], cfg),
           "bias": (h, residual, norm_w, EPS, w, b[:-1], cos, sin, heads, kv, out, cfg)}
    for name, args in bad.items():
        with pytest.raises(ValueError):
            norm_qkv_rope(*args)
        assert not out.any() and torch.equal(kb, kv_buffers(heads, dt)[0]), name
    for bad_out, bad_b in ((out[:, :-1], b), (out, b[:-1])):  # the fold without the rotary
        with pytest.raises(ValueError):
            norm_qkv(h, residual, norm_w, EPS, w, bad_b, heads, bad_out, cfg)
        assert not out.any()


def test_config_parse():
    assert triton_norm_qkv_rope._parse("0") is None
    assert triton_norm_qkv_rope._parse("4,8") == NormQKVConfig(4, 8)
    for bad in ("4", "3,4", "a,b", "4,0"):
        with pytest.raises(ValueError):
            triton_norm_qkv_rope._parse(bad)


@gpu
@pytest.mark.parametrize("pairs,warps", [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8)])
def test_qwen2_shapes_eager_and_in_a_cuda_graph(pairs, warps):
    heads = QKVHeads(q=12, kv=2, dim=128)
    cfg = NormQKVConfig(pairs, warps)
    dt = torch.bfloat16
    args = case(heads, 1536, dt, 2, True, seed=7)
    expected = unfused(*args, heads, cfg, dt)
    assert_close(fused(*args, heads, cfg, dt), expected, dt)
    h, residual, norm_w, w, b, cos, sin, loc = args
    kb, vb = kv_buffers(heads, dt)
    out = torch.empty(1, w.shape[0], dtype=dt, device=DEV)
    kv = triton_ops.KVStore(None, loc, kb, vb)
    norm_qkv_rope(h, residual, norm_w, EPS, w, b, cos, sin, heads, kv, out, cfg)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new_residual = norm_qkv_rope(h, residual, norm_w, EPS, w, b, cos, sin, heads, kv, out,
                                     cfg)
    kb.copy_(kv_buffers(heads, dt)[0])
    vb.copy_(kv_buffers(heads, dt)[1])
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close((new_residual, out, kb, vb), expected, dt)


QWEN2_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2)
QWEN3_1_7B = dict(architecture="Qwen3ForCausalLM", hidden_size=2048, intermediate_size=6144,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128)


@gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("shape,fold", [(QWEN2_1_5B, "norm_qkv_rope"), (QWEN3_1_7B, "norm_qkv")],
                         ids=["qwen2", "qwen3"])
def test_gpu_model_logits_with_the_fold_equal_those_without(tmp_path, monkeypatch, graph, shape,
                                                            fold):
    """A model with Qwen2-1.5B's shapes (qkv bias; the fold with the rotary, `norm_qkv_rope`)
    or Qwen3-1.7B's (q/k norms, no bias; the fold without it, `norm_qkv`, the q/k norms and
    rotary in the kernel after), random bf16 weights, two layers: its one-row decode logits,
    eager and from the decode CUDA graph, with the second layer's add + norm folded into its qkv
    kernel, are those of the engine's separate kernels (within the bf16 rounding an ulp of the
    normed row can move), and the fold ran."""
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    from tests.test_split_sum import decode_logits
    path = str(make_tiny_model(tmp_path / "m", TinyModelSpec(**shape, dtype="bfloat16")))
    monkeypatch.setattr(triton_norm_qkv_rope, "CONFIG", None)
    without = decode_logits(path, 1, graph)
    calls = []
    real = getattr(triton_norm_qkv_rope, fold)
    monkeypatch.setattr(triton_norm_qkv_rope, fold, lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(triton_norm_qkv_rope, "CONFIG", NormQKVConfig(2, 4))
    with_fold = decode_logits(path, 1, graph)
    assert calls, "the fold never ran"
    torch.testing.assert_close(with_fold.float(), without.float(), rtol=0.02, atol=0.02)
    assert with_fold.argmax(-1).equal(without.argmax(-1))
    print("logits equal:", torch.equal(with_fold, without))
