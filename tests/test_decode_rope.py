"""Spec: the decode attention with qkv's epilogue (decode_rope.py) equals the rotary kernel
followed by the decode attention, bit for bit: the output and every KV slot.

The oracle is the unfused chain (`triton_ops.apply_rotary_inplace` summing qkv's split-K
partials, rotating and storing the new keys and values, then `decode_attention` reading them),
itself checked against plain softmax attention in test_triton_kernels.py. On CPU under the
Triton interpreter (fp32 and bf16, tiny ragged batches); on a GPU (`gpu`) bf16 Qwen2-1.5B heads
at 128 requests, the engine's launch, in a CUDA graph under PDL."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.attention.triton_kernels import decode, decode_attention  # noqa: E402
from rollout.attention.triton_kernels.decode_rope import DecodeRope  # noqa: E402
from rollout.layers import triton_ops  # noqa: E402
from rollout.layers.split_sum import SplitSum  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402
from tests.test_triton_kernels import SEQ_LENS, make_paged, reference  # noqa: E402

require_runnable_triton(decode._decode_partial_kernel)


def rope_case(lens, heads, kv_heads, head_dim, splits, dtype, with_bias, seed=0):
    """A paged cache whose new tokens' slots hold NaN (never to be read), qkv's partials (or its
    summed output when splits == 0), bias, cos/sin and the new tokens' slots."""
    p = make_paged(lens, [n - 1 for n in lens], kv_heads, head_dim, dtype=dtype, seed=seed)
    loc = torch.stack([p.slots(b)[-1] for b in range(len(lens))])
    p.k.index_fill_(0, loc, float("nan"))
    p.v.index_fill_(0, loc, float("nan"))
    gen = torch.Generator().manual_seed(seed + 1)
    n = (heads + 2 * kv_heads) * head_dim
    shape = (splits, len(lens), n) if splits else (len(lens), n)
    qkv = torch.randn(shape, generator=gen).to(DEV, torch.float32 if splits else dtype)
    bias = torch.randn(n, generator=gen).to(DEV, dtype) if with_bias else None
    cos, sin = (torch.rand(len(lens), 1, head_dim // 2, generator=gen).mul(2).sub(1)
                .to(DEV, dtype) for _ in range(2))
    return p, DecodeRope(qkv, bias, cos, sin, loc, dtype)


def unfused(p, rope: DecodeRope, heads, config, scale):
    """The rotary kernel (sum, rotary, KV store), then the decode attention: (output, k, v)."""
    k, v = p.k.clone(), p.v.clone()
    batch, kv_heads, head_dim = len(p.seq_lens), k.shape[1], k.shape[2]
    split = rope.qkv.dim() == 3
    out = torch.empty(batch, (heads + 2 * kv_heads) * head_dim, dtype=rope.dtype, device=DEV)
    if not split:
        out.copy_(rope.qkv)
    qk = out[:, :(heads + kv_heads) * head_dim].view(batch, heads + kv_heads, head_dim)
    values = out[:, (heads + kv_heads) * head_dim:].view(batch, kv_heads, head_dim)
    triton_ops.apply_rotary_inplace(
        qk, rope.cos, rope.sin, triton_ops.KVStore(values, rope.loc, k, v),
        source=SplitSum(rope.qkv, out, rope.bias) if split else None)
    attn = decode_attention(qk[:, :heads], k, v, p.req_to_token, p.rows,
                            torch.tensor(p.seq_lens, device=DEV), scale, config)
    return attn, k, v


def fused(p, rope: DecodeRope, heads, config, scale):
    k, v = p.k.clone(), p.v.clone()
    q_shape = torch.full((len(p.seq_lens), heads, k.shape[2]), float("nan"), dtype=rope.dtype,
                         device=DEV)
    attn = decode_attention(q_shape, k, v, p.req_to_token, p.rows,
                            torch.tensor(p.seq_lens, device=DEV), scale, config, rope=rope)
    return attn, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits,with_bias", [(3, True), (2, False), (0, False)])
@pytest.mark.parametrize("config", [
    decode.DecodeConfig(1, block_n=16, preload_kv=True),  # new token: first block or a later one
    decode.DecodeConfig(3, block_n=16),  # in the last non-empty split, some splits empty
    decode.DecodeConfig(8, block_n=16, preload_kv=True)])
def test_fused_rotary_equals_rotary_then_attention(dtype, splits, with_bias, config):
    """qkv as split-K partials (+ bias) or summed; the new token in a preloaded first block, in
    a later block, alone in its split or after empty splits: the same output and KV cache."""
    p, rope = rope_case(SEQ_LENS + [16, 18], 4, 2, 16, splits, dtype, with_bias)
    ref, ref_k, ref_v = unfused(p, rope, 4, config, 0.25)
    out, k, v = fused(p, rope, 4, config, 0.25)
    assert not ref.isnan().any() and not ref_k.isnan().any()
    assert torch.equal(out, ref)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


def test_fused_rotary_matches_plain_attention():
    """Against an independent reference: qkv summed by hand, HF's rotate-half rotary, the new
    key and value put in their slots, plain softmax attention (fp32)."""
    heads, kv_heads, d = 4, 2, 16
    p, rope = rope_case(SEQ_LENS, heads, kv_heads, d, 2, torch.float32, True, seed=5)
    qkv = rope.qkv.sum(0) + rope.bias
    cos = torch.cat([rope.cos, rope.cos], -1)
    sin = torch.cat([rope.sin, rope.sin], -1)
    x = qkv.view(len(SEQ_LENS), heads + 2 * kv_heads, d)
    qk = x[:, :heads + kv_heads]
    rotated = qk * cos + torch.cat([-qk[..., d // 2:], qk[..., :d // 2]], -1) * sin
    out, k, v = fused(p, rope, heads, decode.DecodeConfig(2, block_n=16), 0.3)
    assert torch.allclose(k[rope.loc], rotated[:, heads:], atol=1e-5)
    assert torch.allclose(v[rope.loc], x[:, heads + kv_heads:], atol=1e-5)
    p.k, p.v = k, v
    expected = torch.cat([reference(rotated[b:b + 1, :heads], p, b, 0.3)
                          for b in range(len(SEQ_LENS))])
    assert (out - expected).abs().max().item() <= 1e-4


def test_fused_rotary_bad_inputs_are_refused():
    p, rope = rope_case([3, 5], 4, 2, 16, 2, torch.float32, True)
    q = torch.empty(2, 4, 16, device=DEV)
    lens = torch.tensor([3, 5], device=DEV)
    cases = {"qkv": rope._replace(qkv=rope.qkv[:, :, :-16]),
             "cos/sin": rope._replace(cos=rope.cos[:1]),
             "loc": rope._replace(loc=rope.loc[:1]),
             "bias": rope._replace(bias=rope.bias[:-1]),
             "rounds to": rope._replace(dtype=torch.bfloat16)}
    for match, bad in cases.items():
        with pytest.raises(ValueError, match=match):
            decode_attention(q, p.k, p.v, p.req_to_token, p.rows, lens, 0.25, rope=bad)
    with pytest.raises(ValueError, match="per-head"):
        decode_attention(q, p.k, p.v, p.req_to_token, p.rows, lens, 0.25,
                         decode.DecodeConfig(2, per_head=True), rope=rope)
    odd = rope_case([3, 5], 4, 2, 24, 2, torch.float32, True)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(torch.empty(2, 4, 24, device=DEV), odd[0].k, odd[0].v,
                         odd[0].req_to_token, odd[0].rows, lens, 0.25, rope=odd[1])


@gpu
@pytest.mark.parametrize("batch", [32, 128])
def test_gpu_fused_rotary_in_a_graph_under_pdl(batch):
    """bf16 Qwen2-1.5B heads (12 q, 2 KV, 128 dims), 1-300 keys, qkv as 3 split-K partials +
    bias, the engine's launch for the batch: fused in a CUDA graph under PDL (the cache's new
    slots poisoned before every replay) equals the unfused chain launched eagerly."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 301, (batch,), generator=gen).tolist()
    p, rope = rope_case(lens, 12, 2, 128, 3, torch.bfloat16, True, seed=batch)
    config = decode.decode_launch_config(batch, kv_heads=2)
    scale = 128 ** -0.5
    ref, ref_k, ref_v = unfused(p, rope, 12, config, scale)
    k, v = p.k.clone(), p.v.clone()
    q_shape = torch.empty(batch, 12, 128, dtype=torch.bfloat16, device=DEV)
    out = torch.empty_like(q_shape)
    scratch = decode.decode_buffers(batch, 12, 128, 8, DEV)
    seq_lens = torch.tensor(lens, device=DEV)

    def step():
        k.index_fill_(0, rope.loc, float("nan"))
        v.index_fill_(0, rope.loc, float("nan"))
        decode_attention(q_shape, k, v, p.req_to_token, p.rows, seq_lens, scale, config,
                         scratch, out, rope=rope)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and torch.equal(k, ref_k) and torch.equal(v, ref_v)


@gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("rows", [32, 128, 160])  # qkv split in 2 (TMA), 3 (Gluon), unsplit
def test_gpu_model_logits_equal_with_and_without_the_epilogue(tmp_path, monkeypatch, rows,
                                                              graph):
    """A model with Qwen2-1.5B's shapes (random bf16 weights, two layers) at decode batches
    whose qkv goes to the rotary kernel without the epilogue: its decode logits, eager and from
    the decode CUDA graph, are bit for bit those with ROLLOUT_FUSED_ROPE_ATTENTION=0, and the
    epilogue was launched (and not, with it off; the graphs of 1-16 rows never launch it: their
    qkv kernel does the rotary)."""
    from rollout.attention import triton_backend
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    from tests.test_split_sum import decode_logits
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    launches, real = [], triton_backend.decode_attention

    def counted(*args, **kwargs):
        launches.append(kwargs.get("rope") is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_backend, "decode_attention", counted)
    fused = decode_logits(path, rows, graph)
    assert any(launches) and (graph or all(launches))
    launches.clear()
    monkeypatch.setattr(triton_backend, "FUSED_ROPE_ATTENTION", False)
    assert torch.equal(fused, decode_logits(path, rows, graph))
    assert launches and not any(launches)
