"""Spec: a skinny GEMM split along K may hand back its fp32 partials (a SplitSum) instead of
summing them, and the residual add + RMSNorm that reads them next (triton_ops.split_add_rms_norm,
RMSNorm given a SplitSum) sums them itself — with the same bits as the reduce kernel followed by
fused_add_rms_norm, and within the RMSNorm's 2-ulp bound of the torch expression.

On CPU under the Triton interpreter (fp32 and bf16, ragged hidden sizes, 2-7 splits, the FMA
and the TMA kernel); on a GPU (marked `gpu`) on the Qwen2-1.5B down shape at decode batches, in
a CUDA graph, and a model's logits with and without the deferred sum, bit for bit."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.layers import linear as linear_mod  # noqa: E402
from rollout.layers import triton_gemv, triton_ops  # noqa: E402
from rollout.layers.norm import RMSNorm  # noqa: E402
from rollout.layers.split_sum import SplitSum  # noqa: E402
from rollout.layers.triton_gemv import Config, skinny_linear  # noqa: E402
from rollout.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402
from tests.helpers import DEV, RunnerDriver, gpu, require_runnable_triton  # noqa: E402
from tests.test_fused_ops import EPS, check, rand, ref_rms_norm, rope  # noqa: E402

require_runnable_triton(triton_ops._rms_norm_kernel)


def ordered_sum(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The partials summed in split order in fp32, rounded once: the reduce kernel's output."""
    acc = torch.zeros_like(partials[0])
    for p in partials:
        acc = acc + p
    return acc.to(dtype)


def as_split_sum(partials: torch.Tensor, dtype: torch.dtype) -> SplitSum:
    return SplitSum(partials, torch.empty(partials.shape[1:], dtype=dtype, device=partials.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 96), (17, 1536)])
def test_split_add_rms_norm_equals_reduce_then_add_norm(dtype, splits, rows, hidden):
    partials = rand(splits, rows, hidden, dtype=torch.float32, seed=splits * rows)
    res = rand(rows, hidden, dtype=dtype, seed=99)
    w = rand(hidden, dtype=dtype, seed=7, scale=0.3) + 1
    s = as_split_sum(partials, dtype)
    out, new_res = triton_ops.split_add_rms_norm(s, res, w, EPS)
    reduced = s.tensor()
    assert torch.equal(reduced, ordered_sum(partials, dtype))
    ref_out, ref_res = triton_ops.fused_add_rms_norm(reduced, res, w, EPS)
    assert torch.equal(new_res, ref_res) and torch.equal(out, ref_out)  # the same bits
    assert torch.equal(new_res, reduced + res)
    check(out, ref_rms_norm(reduced + res, w), dtype, exact=False, bound_ulps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_module_takes_a_split_sum(dtype):
    """RMSNorm.forward(SplitSum, residual) is the add + norm of the summed output; without a
    residual it sums first, then norms."""
    partials = rand(3, 5, 96, dtype=torch.float32, seed=1)
    res = rand(5, 96, dtype=dtype, seed=2)
    norm = RMSNorm(96, EPS).to(device=DEV, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(96, dtype=dtype, seed=3, scale=0.3) + 1)
    reduced = ordered_sum(partials, dtype)
    out, new_res = norm(as_split_sum(partials, dtype), res)
    assert torch.equal(new_res, reduced + res)
    check(out, ref_rms_norm(reduced + res, norm.weight), dtype, exact=False, bound_ulps=2)
    check(norm(as_split_sum(partials, dtype)), ref_rms_norm(reduced, norm.weight), dtype,
          exact=False, bound_ulps=2)


SPLIT_CONFIGS = {
    "fma_split": Config(8, 16, 3),
    "fma_split_lookahead": Config(8, 16, 2, preload=2, lookahead=True),
    "tma_split": Config(16, 16, 3, dot=True, block_m=16, tma=True),
    "tma_swap_split": Config(32, 16, 2, dot=True, num_stages=4, block_m=16, tma=True,
                             swap_ab=True),
}


@pytest.mark.parametrize("config", list(SPLIT_CONFIGS))
def test_skinny_linear_defers_its_split(config):
    """defer_split with a split config: a SplitSum whose sum is the reduced output bit for bit;
    with a bias, the bias goes with it; no split: the tensor as before."""
    cfg = SPLIT_CONFIGS[config]
    f32 = torch.float32
    w, b = rand(40, 96, dtype=f32, seed=1), rand(40, dtype=f32, seed=2)
    for m in (1, 3, 16):
        x = rand(m, 96, dtype=f32, seed=m)
        deferred = skinny_linear(x, w, config=cfg, defer_split=True)
        assert isinstance(deferred, SplitSum) and deferred.splits == cfg.split_k
        assert deferred.shape == (m, 40) and deferred.dtype == x.dtype
        assert torch.equal(ordered_sum(deferred.partials, x.dtype),
                           skinny_linear(x, w, config=cfg))
        assert torch.equal(deferred.tensor(), skinny_linear(x, w, config=cfg))
        biased = skinny_linear(x, w, b, config=cfg, defer_split=True)  # the bias rides along
        assert isinstance(biased, SplitSum) and torch.equal(biased.bias, b)
        assert torch.equal(biased.tensor(), skinny_linear(x, w, b, config=cfg))
        one = cfg._replace(split_k=1)
        assert isinstance(skinny_linear(x, w, config=one, defer_split=True), torch.Tensor)


def qkv_case(rows, q_heads, kv_heads, splits, dtype, with_bias, seed=0):
    """Partials of a qkv output [rows, (q + 2 kv) · 64] (+ bias), the rope tables, KV slots."""
    width = (q_heads + 2 * kv_heads) * 64
    partials = rand(splits, rows, width, dtype=torch.float32, seed=seed)
    bias = rand(width, dtype=dtype, seed=seed + 1) if with_bias else None
    cos, sin = rope(rows, 64, dtype, seed=rows)
    loc = torch.randperm(40, generator=torch.Generator().manual_seed(rows))[:rows].add(1).to(DEV)
    return partials, bias, cos, sin, loc


def qkv_views(qkv, q_heads, kv_heads):
    rows = qkv.shape[0]
    return (qkv[:, :(q_heads + kv_heads) * 64].view(rows, q_heads + kv_heads, 64),
            qkv[:, (q_heads + kv_heads) * 64:].view(rows, kv_heads, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rows,heads,splits", [(1, (4, 2), 2), (5, (6, 1), 3), (17, (12, 2), 4)])
def test_rotary_from_split_equals_reduce_then_rotary(dtype, with_bias, store, qk_norm, rows, heads,
                                                     splits):
    """The rotary kernel given qkv's split-K partials (+ bias) writes the qkv output — q and k
    (Qwen3: normed and) rotated, v as summed — and the KV cache exactly as the reduce kernel
    followed by the rotary kernel do."""
    q_heads, kv_heads = heads
    partials, bias, cos, sin, loc = qkv_case(rows, q_heads, kv_heads, splits, dtype, with_bias,
                                             seed=rows)
    gen = torch.Generator().manual_seed(3)
    norm = triton_ops.QKNorm(*(torch.randn(64, generator=gen).add(1).to(DEV, dtype)
                               for _ in range(2)), 1e-6, q_heads) if qk_norm else None
    reduced = torch.empty(partials.shape[1:], dtype=dtype, device=DEV)
    triton_gemv.reduce_split(partials, bias, reduced, False, splits)
    results = []
    for deferred in (False, True):
        qkv = torch.full_like(reduced, float("nan")) if deferred else reduced.clone()
        source = SplitSum(partials, qkv, bias) if deferred else None
        qk, v = qkv_views(qkv, q_heads, kv_heads)
        kb = torch.zeros(48, kv_heads, 64, dtype=dtype, device=DEV)
        vb = torch.zeros_like(kb)
        kv = triton_ops.KVStore(v, loc, kb, vb) if store else None
        triton_ops.apply_rotary_inplace(qk, cos, sin, kv=kv, source=source, qk_norm=norm)
        results.append((qkv, kb, vb))
    (ref, ref_kb, ref_vb), (out, kb, vb) = results
    assert torch.equal(out, ref) and torch.equal(kb, ref_kb) and torch.equal(vb, ref_vb)
    if store:
        assert torch.equal(vb[loc], ref[:, (q_heads + kv_heads) * 64:].view(rows, kv_heads, 64))


def test_rotary_source_must_be_the_qkv_output():
    partials, bias, cos, sin, _ = qkv_case(3, 4, 2, 2, torch.float32, False)
    qkv = torch.empty(partials.shape[1:], device=DEV)
    qk, _ = qkv_views(qkv, 4, 2)
    other = SplitSum(partials, torch.empty_like(qkv))  # another tensor's partials
    with pytest.raises(ValueError, match="leading heads"):
        triton_ops.apply_rotary_inplace(qk, cos, sin, source=other)
    no_values = SplitSum(partials[:, :, :6 * 64].contiguous(), qkv[:, :6 * 64].contiguous())
    with pytest.raises(ValueError, match="leading heads"):
        triton_ops.apply_rotary_inplace(qk, cos, sin, source=no_values)


def test_split_sum_refuses_bad_partials():
    with pytest.raises(ValueError, match="fp32"):
        SplitSum(torch.zeros(2, 3, 4, dtype=torch.bfloat16), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="S >= 2"):
        SplitSum(torch.zeros(1, 3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="out"):
        SplitSum(torch.zeros(2, 3, 4), torch.zeros(3, 5))
    s = SplitSum(torch.zeros(2, 3, 64, device=DEV), torch.zeros(3, 64, device=DEV))
    with pytest.raises(ValueError, match="one dtype"):
        triton_ops.split_add_rms_norm(s, torch.zeros(3, 64, device=DEV, dtype=torch.bfloat16),
                                      torch.ones(64, device=DEV), EPS)
    with pytest.raises(ValueError, match="one dtype"):
        triton_ops.split_add_rms_norm(s, torch.zeros(4, 64, device=DEV),
                                      torch.ones(64, device=DEV), EPS)
    with pytest.raises(ValueError, match="bias"):
        SplitSum(torch.zeros(2, 3, 64), torch.zeros(3, 64), torch.zeros(63))
    biased = SplitSum(torch.zeros(2, 3, 64, device=DEV), torch.zeros(3, 64, device=DEV),
                      torch.zeros(64, device=DEV))
    with pytest.raises(ValueError, match="sum them first"):
        triton_ops.split_add_rms_norm(biased, torch.zeros(3, 64, device=DEV),
                                      torch.ones(64, device=DEV), EPS)


# ---- GPU: the Qwen2-1.5B down shape at decode batches, in a CUDA graph, and a whole model -----
@gpu
@pytest.mark.parametrize("rows", [1, 32, 64, 128])
def test_gpu_down_split_then_add_norm_in_a_graph(rows):
    """down (K = 8,960) split along K, its partials summed by the add + norm: the same bits as
    reduce + fused_add_rms_norm, eager and replayed in a CUDA graph. At 32-128 rows the table's
    entry (the Gluon GEMM on a Hopper GPU, elsewhere the TMA one it replaced)."""
    w = rand(1536, 8960, dtype=torch.bfloat16, seed=1) * 8960 ** -0.5
    x = rand(rows, 8960, dtype=torch.bfloat16, seed=2)
    res = rand(rows, 1536, dtype=torch.bfloat16, seed=3)
    nw = rand(1536, dtype=torch.bfloat16, seed=4, scale=0.3) + 1
    key = (rows, 1536, 8960, False)
    cfg = (Config(2, 256, 5, 8, preload=2, lookahead=True) if rows == 1
           else triton_gemv._runnable(triton_gemv._config(*key), key, x))

    def deferred():
        return triton_ops.split_add_rms_norm(skinny_linear(x, w, config=cfg, defer_split=True),
                                             res, nw, EPS)
    ref = triton_ops.fused_add_rms_norm(skinny_linear(x, w, config=cfg), res, nw, EPS)
    eager = deferred()
    assert all(torch.equal(a, b) for a, b in zip(eager, ref))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = deferred()
    x.copy_(rand(rows, 8960, dtype=torch.bfloat16, seed=5))
    graph.replay()
    ref = triton_ops.fused_add_rms_norm(skinny_linear(x, w, config=cfg), res, nw, EPS)
    assert all(torch.equal(a, b) for a, b in zip(captured, ref))


def decode_logits(path: str, rows: int, graph: bool) -> torch.Tensor:
    """Logits of one decode step of `rows` requests after a prefill (bf16, CUDA)."""
    driver = RunnerDriver(path, device="cuda", dtype="bfloat16", cuda_graph=graph)
    prompts = [[3 + (7 * r + i) % 250 for i in range(5 + r % 4)] for r in range(rows)]
    driver.prefill(prompts)
    return driver.decode([11 + r for r in range(rows)]).clone()


@gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("rows,qkv_split", [(1, 1), (32, 1), (64, 1), (128, 1), (32, 2),
                                            (128, 3)])
def test_gpu_model_logits_equal_with_and_without_the_deferred_sum(tmp_path, monkeypatch, rows,
                                                                  qkv_split, graph):
    """A model with Qwen2-1.5B's shapes (random bf16 weights, two layers) at the batches where
    the table splits down's K (and o's; qkv's where the table or `qkv_split` > 1 splits it, its
    partials and bias summed by the rotary kernel): its decode logits, eager and from the decode
    CUDA graph, are bit for bit those of the same model whose GEMMs sum their partials
    themselves (ROLLOUT_DEFER_SPLIT_K=0)."""
    assert triton_gemv._config(rows, 1536, 8960).split_k > 1  # else this tests nothing
    if qkv_split > 1:
        key = (rows, 2048, 1536, False)
        monkeypatch.setitem(triton_gemv._TUNED, key,
                            triton_gemv._config(*key)._replace(split_k=qkv_split))
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    deferred = decode_logits(path, rows, graph)
    monkeypatch.setattr(linear_mod, "DEFER_SPLIT_K", False)
    assert torch.equal(deferred, decode_logits(path, rows, graph))
