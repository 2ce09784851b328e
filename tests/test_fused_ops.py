"""Spec: the fused Triton ops of rollout/layers/triton_ops.py equal the torch expressions they
replace on CUDA (HF's RMSNorm, the residual add, silu(gate) * up, rotary.apply_rotary).

On CPU the kernels run under the Triton interpreter: fp32 within 1e-5 of the torch expression,
bf16 bit for bit where triton_ops' docstring claims it (residual sums, rotary, RMSNorm given the
same mean) and within its stated bound otherwise (RMSNorm: 2 bf16 ulps; silu_and_mul under the
interpreter, whose exp is numpy's: 2 ulps). On a GPU (tests marked `gpu`): bf16 on model-sized
shapes, silu_and_mul bit for bit, and the ops captured in a CUDA graph."""
import contextlib

import pytest
import torch

pytest.importorskip("triton")

from rollout.layers import triton_ops  # noqa: E402
from rollout.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402
from tests.helpers import DEV, RunnerDriver, gpu, require_runnable_triton  # noqa: E402
from tests.test_model_parity import PROMPTS  # noqa: E402

require_runnable_triton(triton_ops._rms_norm_kernel)

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]



# ---- references: the torch expressions the kernels replace -------------------------------------
def ref_rms_norm(x, w):  # HF's LlamaRMSNorm
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def ref_silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (representable values apart), elementwise."""
    def ordered(t):
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -32768 - i, i)
    return (ordered(a) - ordered(b)).abs()


def check(out, ref, dtype, exact: bool, bound_ulps: int = 0):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if dtype == torch.float32:
        assert (out - ref).abs().max().item() <= 1e-5
    elif exact:
        assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} differ"
    else:
        dist = ulps(out, ref)
        assert dist.max().item() <= bound_ulps, f"{dist.max().item()} ulps"
        assert (dist > 0).float().mean().item() <= 0.01, f"{(dist > 0).sum().item()} differ"


def rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEV, dtype=dtype)


def qkv_views(rows, q_heads, kv_heads, head_dim, dtype, seed):
    """qk [T, q+kv heads, D] as the model gets it: a strided view of a fused qkv output."""
    qkv = rand(rows, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    qk = qkv[:, :(q_heads + kv_heads) * head_dim].view(rows, q_heads + kv_heads, head_dim)
    assert not qk.is_contiguous() or rows == 1
    return qk


def rope(rows, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (rows,), generator=gen).to(DEV)
    return RotaryEmbedding(head_dim, 4096, 1e6).to(DEV).lookup(positions, dtype)


# ---- CPU (interpreter) and GPU: small ragged shapes --------------------------------------------
ROWS = [1, 3, 17]
HIDDEN = [64, 96, 1536]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS + [300])  # 300: past the few-rows launch (`_norm_warps`)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm(dtype, rows, hidden):
    x, res = rand(rows, hidden, dtype=dtype, seed=rows), rand(rows, hidden, dtype=dtype, seed=99)
    w = rand(hidden, dtype=dtype, seed=7, scale=0.3) + 1
    out, new_res = triton_ops.fused_add_rms_norm(x, res, w, EPS)
    s = x + res
    assert torch.equal(new_res, s)  # one fp32 add, one rounding: exact in every dtype
    check(out, ref_rms_norm(s, w), dtype, exact=False, bound_ulps=2)
    check(triton_ops.rms_norm(x, w, EPS), ref_rms_norm(x, w), dtype, exact=False, bound_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_per_head_in_place(dtype, rows):
    """Qwen3's q/k norms: rows of head_dim in a strided [T, heads, D] view, written in place."""
    qk = qkv_views(rows, 4, 2, 64, dtype, seed=rows)
    w = rand(64, dtype=dtype, seed=5, scale=0.3) + 1
    q, k = qk.split([4, 2], dim=1)
    expected = torch.cat((ref_rms_norm(q, w), ref_rms_norm(k, 2 * w)), dim=1)
    assert triton_ops.rms_norm(q, w, EPS, out=q) is q
    triton_ops.rms_norm(k, 2 * w, EPS, out=k)
    check(qk, expected, dtype, exact=False, bound_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", HIDDEN)
def test_silu_and_mul(dtype, rows, inter):
    gate_up = rand(rows, 2 * inter, dtype=dtype, seed=rows + inter)
    exact_exp = DEV.type == "cuda"  # libdevice expf on a GPU; numpy's exp in the interpreter
    check(triton_ops.silu_and_mul(gate_up), ref_silu_and_mul(gate_up), dtype,
          exact=exact_exp, bound_ulps=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_rotary_in_place(dtype, rows, head_dim):
    qk = qkv_views(rows, 4, 2, head_dim, dtype, seed=rows)
    cos, sin = rope(rows, head_dim, dtype, seed=rows)
    expected = apply_rotary(qk.clone(), cos, sin)
    assert triton_ops.apply_rotary_inplace(qk, cos, sin) is qk
    check(qk, expected, dtype, exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_rotary_with_kv_store_equals_rotary_then_set_kv(dtype, rows, heads):
    """The fused store writes what `rotary then TokenToKVPool.set_kv` writes, bit for bit: the
    rotated key heads and the values at each token's slot, nothing else (buffer dtype fp32 too,
    as a KV cache in another dtype would be)."""
    from rollout.memory import TokenToKVPool
    q_heads, kv_heads = heads
    qkv = rand(rows, (q_heads + 2 * kv_heads) * 64, dtype=dtype, seed=rows)
    qk = qkv[:, :(q_heads + kv_heads) * 64].view(rows, q_heads + kv_heads, 64)
    v = qkv[:, (q_heads + kv_heads) * 64:].view(rows, kv_heads, 64)
    cos, sin = rope(rows, 64, dtype, seed=rows)
    loc = torch.randperm(40, generator=torch.Generator().manual_seed(rows))[:rows].add(1).to(DEV)
    for buf_dtype in (dtype, torch.float32):
        pool = TokenToKVPool(48, 1, kv_heads, 64, buf_dtype, "cpu")
        kb, vb = (b.to(DEV) for b in (pool.k_buffers[0], pool.v_buffers[0]))
        kb.normal_(generator=torch.Generator(DEV).manual_seed(1))
        vb.normal_(generator=torch.Generator(DEV).manual_seed(2))
        ref_k, ref_v = kb.clone(), vb.clone()
        expected = apply_rotary(qk.clone(), cos, sin)
        ref_k[loc] = expected[:, q_heads:].to(buf_dtype)
        ref_v[loc] = v.to(buf_dtype)
        x = qk.clone()
        triton_ops.apply_rotary_inplace(x, cos, sin, kv=triton_ops.KVStore(v, loc, kb, vb))
        check(x, expected, dtype, exact=True)
        assert torch.equal(kb, ref_k) and torch.equal(vb, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 64), ((6, 1), 96), ((32, 4), 128)])
def test_rotary_with_qk_norm_equals_norms_then_rotary(dtype, rows, heads, head_dim):
    """Qwen3's q/k norms inside the rotary kernel: HF's per-head RMSNorm (q_norm's weight on the
    query heads, k_norm's on the key heads) then the rotation, as the two-kernel path computes
    it; the KV cache gets the normed and rotated keys. fp32 within 1e-5; bf16 within one rounding
    of the mean (the sum order), which the rotation can carry a few ulps further."""
    q_heads, kv_heads = heads
    qkv = rand(rows, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=rows)
    qk = qkv[:, :(q_heads + kv_heads) * head_dim].view(rows, q_heads + kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    cos, sin = rope(rows, head_dim, dtype, seed=rows)
    wq = rand(head_dim, dtype=dtype, seed=5, scale=0.3) + 1
    wk = rand(head_dim, dtype=dtype, seed=6, scale=0.3) + 1
    normed = torch.cat((ref_rms_norm(qk[:, :q_heads], wq), ref_rms_norm(qk[:, q_heads:], wk)), 1)
    expected = apply_rotary(normed, cos, sin)
    loc = torch.randperm(40, generator=torch.Generator().manual_seed(rows))[:rows].add(1).to(DEV)
    kb = torch.zeros(48, kv_heads, head_dim, dtype=dtype, device=DEV)
    vb = torch.zeros_like(kb)
    out = triton_ops.apply_rotary_inplace(
        qk, cos, sin, kv=triton_ops.KVStore(v, loc, kb, vb),
        qk_norm=triton_ops.QKNorm(wq, wk, EPS, q_heads))
    assert out is qk
    if dtype == torch.float32:
        assert (qk - expected).abs().max().item() <= 1e-5
    else:
        assert (qk.float() - expected.float()).abs().max().item() <= 0.05
        assert (qk != expected).float().mean().item() <= 0.02
    assert torch.equal(kb[loc], qk[:, q_heads:]) and torch.equal(vb[loc], v)


def test_rotary_qk_norm_bad_weights_are_refused():
    x, cs = torch.zeros(2, 6, 64, device=DEV), torch.zeros(2, 1, 32, device=DEV)
    w = torch.ones(64, device=DEV)
    for norm in (triton_ops.QKNorm(torch.ones(32, device=DEV), w, EPS, 4),  # head_dim
                 triton_ops.QKNorm(w, torch.ones(64, 2, device=DEV)[:, 0], EPS, 4),  # strided
                 triton_ops.QKNorm(w, w, EPS, 6)):  # no key heads left
        with pytest.raises(ValueError, match="q/k norm"):
            triton_ops.apply_rotary_inplace(x, cs, cs, qk_norm=norm)


def test_rotary_kv_store_bad_shapes_are_refused():
    x = torch.zeros(2, 6, 64, device=DEV)
    cs = torch.zeros(2, 1, 32, device=DEV)
    kb = torch.zeros(8, 2, 64, device=DEV)
    loc = torch.zeros(2, dtype=torch.int64, device=DEV)
    bad = [triton_ops.KVStore(torch.zeros(2, 2, 32, device=DEV), loc, kb, kb),  # head_dim
           triton_ops.KVStore(torch.zeros(2, 2, 64, device=DEV), loc[:1], kb, kb),  # loc
           triton_ops.KVStore(torch.zeros(2, 2, 64, device=DEV), loc, kb[:, :1], kb),  # kv heads
           triton_ops.KVStore(torch.zeros(2, 64, 2, device=DEV).transpose(1, 2), loc, kb, kb)]
    for kv in bad:
        with pytest.raises(ValueError, match="KV store"):
            triton_ops.apply_rotary_inplace(x, cs, cs, kv=kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_lookup_is_the_cast_table_rows(dtype):
    """`lookup`'s cos/sin (views of one gather) are the float32 tables' rows rounded to dtype."""
    rot = RotaryEmbedding(64, 512, 1e4).to(DEV)
    positions = torch.tensor([0, 5, 511, 5], device=DEV)
    cos, sin = rot.lookup(positions, dtype)
    assert cos.shape == sin.shape == (4, 1, 32) and cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, rot.cos_cache[positions].unsqueeze(1).to(dtype))
    assert torch.equal(sin, rot.sin_cache[positions].unsqueeze(1).to(dtype))


def test_zero_rows_launch_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched a kernel for 0 rows")
    for name in ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel"):
        monkeypatch.setattr(triton_ops, name, NoLaunch())
    x, w = torch.empty(0, 64, device=DEV), torch.ones(64, device=DEV)
    out, res = triton_ops.fused_add_rms_norm(x, x, w, EPS)
    assert out.shape == res.shape == (0, 64)
    assert triton_ops.rms_norm(x, w, EPS).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, device=DEV)).shape == (0, 64)
    qk, cs = torch.empty(0, 3, 64, device=DEV), torch.empty(0, 1, 32, device=DEV)
    assert triton_ops.apply_rotary_inplace(qk, cs, cs).shape == (0, 3, 64)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="weight"):
        triton_ops.rms_norm(torch.zeros(2, 64, device=DEV), torch.ones(32, device=DEV), EPS)
    with pytest.raises(ValueError, match="MAX_HIDDEN"):
        n = 2 * triton_ops.MAX_HIDDEN
        triton_ops.rms_norm(torch.zeros(1, n, device=DEV), torch.ones(n, device=DEV), EPS)
    with pytest.raises(ValueError, match="one dtype"):
        x = torch.zeros(2, 64, device=DEV)
        triton_ops.fused_add_rms_norm(x, x.bfloat16(), torch.ones(64, device=DEV), EPS)
    with pytest.raises(ValueError, match="2·I"):
        triton_ops.silu_and_mul(torch.zeros(2, 63, device=DEV))
    with pytest.raises(ValueError, match="cos/sin"):
        cs = torch.zeros(2, 1, 32, device=DEV)
        triton_ops.apply_rotary_inplace(torch.zeros(2, 3, 64, device=DEV).bfloat16(), cs, cs)


# ---- GPU: bf16 on model-sized shapes, and inside a CUDA graph ----------------------------------
GPU_ROWS = [1, 7, 300, 2049]


@gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("hidden", [1536, 3584, 5120, 8192])
def test_gpu_bf16_add_rms_norm(rows, hidden):
    x = rand(rows, hidden, dtype=torch.bfloat16, seed=1)
    res = rand(rows, hidden, dtype=torch.bfloat16, seed=2)
    w = rand(hidden, dtype=torch.bfloat16, seed=3, scale=0.3) + 1
    out, new_res = triton_ops.fused_add_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, x + res)
    check(out, ref_rms_norm(x + res, w), torch.bfloat16, exact=False, bound_ulps=2)


@gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("heads", [(12, 2), (16, 8), (64, 8)])
def test_gpu_bf16_qk_norm_and_rotary(rows, heads):
    q_heads, kv_heads = heads
    qk = qkv_views(rows, q_heads, kv_heads, 128, torch.bfloat16, seed=rows)
    w = rand(128, dtype=torch.bfloat16, seed=4, scale=0.3) + 1
    cos, sin = rope(rows, 128, torch.bfloat16, seed=rows)
    expected = apply_rotary(ref_rms_norm(qk, w), cos, sin)
    normed = ref_rms_norm(qk, w)
    triton_ops.rms_norm(qk, w, EPS, out=qk)
    check(qk, normed, torch.bfloat16, exact=False, bound_ulps=2)
    qk.copy_(normed)
    triton_ops.apply_rotary_inplace(qk, cos, sin)
    assert torch.equal(qk, expected)


@gpu
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("inter", [8960, 18944])
def test_gpu_bf16_silu_and_mul(rows, inter):
    gate_up = rand(rows, 2 * inter, dtype=torch.bfloat16, seed=rows, scale=4.0)
    check(triton_ops.silu_and_mul(gate_up), ref_silu_and_mul(gate_up), torch.bfloat16, exact=True)


@gpu
def test_gpu_ops_in_cuda_graph():
    """Captured once, replayed on new data in the same buffers: equals eager."""
    dt, rows, hidden, inter = torch.bfloat16, 8, 1536, 8960
    x, res = rand(rows, hidden, dtype=dt, seed=1), rand(rows, hidden, dtype=dt, seed=2)
    gate_up = rand(rows, 2 * inter, dtype=dt, seed=3)
    qk = qkv_views(rows, 12, 2, 128, dt, seed=4)
    cos, sin = rope(rows, 128, dt, seed=5)
    w = rand(hidden, dtype=dt, seed=6) + 1
    wh = rand(128, dtype=dt, seed=7) + 1

    def step():
        out, new_res = triton_ops.fused_add_rms_norm(x, res, w, EPS)
        triton_ops.rms_norm(qk, wh, EPS, out=qk)
        triton_ops.apply_rotary_inplace(qk, cos, sin)
        return out, new_res, triton_ops.silu_and_mul(gate_up), qk.clone()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (10, 20):
        buffers = (x, res, gate_up, qk)
        inputs = [rand(*t.shape, dtype=dt, seed=seed + i) for i, t in enumerate(buffers)]
        for t, new in zip(buffers, inputs):
            t.copy_(new)
        graph.replay()
        for t, new in zip(buffers, inputs):
            t.copy_(new)
        eager = step()
        torch.cuda.synchronize()
        for g, e in zip(captured, eager):
            assert torch.equal(g, e)


# ---- CPU: the decoder's CUDA branch, run under the interpreter --------------------------------
@contextlib.contextmanager
def tensors_claim_cuda():
    """Every tensor answers is_cuda=True, so the model takes its fused-op branch on CPU."""
    saved = torch.Tensor.is_cuda
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        torch.Tensor.is_cuda = saved


def greedy_logits(driver: RunnerDriver, steps: int = 3) -> torch.Tensor:
    logits = [driver.prefill([list(p) for p in PROMPTS])]
    for _ in range(steps):
        logits.append(driver.decode(logits[-1].argmax(-1).tolist()))
    return torch.stack(logits)


@pytest.mark.skipif(DEV.type == "cuda", reason="on a GPU the model takes this branch for real")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_fused_branch_matches_torch_branch(tiny_dirs, dtype):
    """Fused ops, SGLang's residual stream, in-place q/k norms and rotary (Qwen3), the rotary
    kernel writing the KV cache, wired as on a GPU give the plain-torch branch's logits: fp32
    within 1e-5, bf16 bit for bit here."""
    from rollout.attention.triton_kernels import store_kv
    path = tiny_dirs["Qwen3ForCausalLM"]
    fused_driver, torch_driver = RunnerDriver(path, dtype=dtype), RunnerDriver(path, dtype=dtype)
    pool = fused_driver.runner.token_to_kv_pool
    pool._fused = store_kv  # as on a GPU: the rotary kernel stores K and V, the backend does not
    with tensors_claim_cuda():
        fused = greedy_logits(fused_driver)
    plain = greedy_logits(torch_driver)
    if dtype == "float32":
        assert (fused - plain).abs().max().item() <= 1e-5
    else:
        assert torch.equal(fused, plain)
