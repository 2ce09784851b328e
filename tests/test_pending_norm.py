"""Spec: the residual add and the RMSNorm done inside the one-row GEMVs (rollout/layers/
pending_norm.py) equal the norm kernel followed by the plain GEMV.

* A GEMV reading a PendingNorm (the fused gate/up + SiLU, the fused qkv + rotary + KV store)
  gives what `triton_ops.rms_norm` then the same GEMV (same launch config) gives: in fp32 within
  1e-5 (the mean square is summed in another order); in bf16 the same roundings, so outputs
  equal but where that order flips a rounding (a few elements, ≤ 2 bf16 ulps of the normed input).
* A GEMV with `add_to` leaves add_to + its output, rounded as torch adds, bit for bit.
* Configs they cannot run (split K, K in more than three chunks, the dot kernel) are refused.

On CPU under the Triton interpreter on tiny ragged shapes (K not a multiple of the chunk; one and
three chunks; one and three rows; every preload); on a GPU (`gpu`): the Qwen2-1.5B shapes with
the engine's configs, and a decode step of a two-layer model with the norms in the GEMVs against
the norm kernels."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.layers import triton_gemv, triton_ops, triton_qkv_rope  # noqa: E402
from rollout.layers.pending_norm import PendingNorm  # noqa: E402
from rollout.layers.triton_gemv import Config  # noqa: E402
from rollout.layers.triton_qkv_rope import QKVHeads  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402
from tests.test_triton_qkv_rope import case, kv_buffers  # noqa: E402

require_runnable_triton(triton_gemv._gemv_fma_kernel)

EPS = 1e-6


def rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEV, dtype=dtype)


def pending(rows, k, dtype, seed=0):
    h = rand(rows, k, dtype=dtype, seed=seed, scale=3.0)
    w = (1.0 + 0.3 * rand(k, dtype=torch.float32, seed=seed + 7)).to(dtype)
    return PendingNorm(h, w, EPS)


def assert_close(got, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return
    # bf16: the same roundings; a flipped rounding of a normed input moves a few outputs
    differ = (got != ref).float().mean().item()
    assert differ < 0.05, f"{differ:.1%} of the outputs differ"
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


# (K, block_k): three chunks with a ragged last one, two, one; preload 1-3 (1: chunks after the wait)
NORM_CASES = [(80, 32, 3), (80, 32, 1), (64, 32, 2), (24, 32, 1), (96, 32, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("k,block_k,preload", NORM_CASES)
def test_gate_up_silu_normalizes_a_pending_norm(dtype, rows, k, block_k, preload):
    inter = 24
    norm = pending(rows, k, dtype)
    w = rand(2 * inter, k, dtype=dtype, seed=3, scale=k ** -0.5)
    cfg = Config(4, block_k, preload=preload, lookahead=True)
    got = triton_gemv.skinny_gate_up_silu(norm, w, inter, config=cfg)
    ref = triton_gemv.skinny_gate_up_silu(norm.tensor(), w, inter, config=cfg)
    assert_close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_rope_normalizes_a_pending_norm(dtype, rows, bias):
    heads = QKVHeads(3, 1, 8)
    x, w, b, cos, sin, loc = case(rows, heads, 40, dtype, bias, seed=5)
    norm = pending(rows, 40, dtype, seed=9)
    cfg = Config(4, 16, preload=2)  # 40 = three chunks of 16, the last one ragged
    got = []
    for inp in (norm, norm.tensor()):
        kb, vb = kv_buffers(heads, dtype)
        out = triton_qkv_rope.qkv_rope(inp, w, b, cos, sin, heads,
                                       triton_ops.KVStore(None, loc, kb, vb), cfg)
        got.append((out, kb, vb))
    for g, r in zip(*got):
        assert_close(g, r, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cfg", [Config(8, 32, preload=3, lookahead=True), Config(4, 16)])
def test_add_to_adds_the_output_into_the_residual(dtype, rows, cfg):
    x = rand(rows, 72, dtype=dtype, seed=1)
    w = rand(40, 72, dtype=dtype, seed=2, scale=72 ** -0.5)
    residual = rand(rows, 40, dtype=dtype, seed=4)
    expected = residual + triton_gemv.skinny_linear(x, w, config=cfg)  # torch's rounded add
    out = triton_gemv.skinny_linear(x, w, config=cfg, add_to=residual)
    assert out.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, expected)


def test_unsupported_configs_are_refused():
    norm = pending(1, 80, torch.float32)
    w = rand(48, 80, dtype=torch.float32, seed=3)
    x = rand(1, 80, dtype=torch.float32, seed=1)
    for cfg in (Config(4, 16), Config(4, 32, 2), Config(16, 32, dot=True)):  # 5 chunks; split
        with pytest.raises(ValueError):
            triton_gemv.skinny_gate_up_silu(norm, w, 24, config=cfg)
    residual = torch.zeros(1, 48, device=DEV)
    before = residual.clone()
    for cfg in (Config(4, 16, 2), Config(16, 32, dot=True)):
        with pytest.raises(ValueError):
            triton_gemv.skinny_linear(x, w, config=cfg, add_to=residual)
    with pytest.raises(ValueError):
        triton_gemv.skinny_linear(x, w, add_to=torch.zeros(1, 47, device=DEV))
    assert torch.equal(residual, before)  # refused before anything ran
    with pytest.raises(ValueError):
        PendingNorm(x, torch.ones(79, device=DEV), EPS)
    assert triton_gemv.norm_chunks(80, Config(4, 16)) == 0
    assert triton_gemv.norm_chunks(80, Config(4, 32)) == 3
    assert triton_gemv.add_to_config(1, 1536, 8960).split_k == 1


# ---- GPU: the engine's shapes and configs -----------------------------------------------------
@gpu
def test_gpu_qwen2_shapes_with_the_engine_configs():
    torch.manual_seed(0)
    dt = torch.bfloat16
    norm = PendingNorm(torch.randn(1, 1536, device=DEV, dtype=dt) * 4,
                       (1 + 0.2 * torch.randn(1536, device=DEV)).to(dt), EPS)
    gu = torch.randn(17920, 1536, device=DEV, dtype=dt) * 0.03
    assert triton_gemv.supports_pending_norm(norm, gu, gated=True)
    assert_close(triton_gemv.skinny_gate_up_silu(norm, gu, 8960),
                 triton_gemv.skinny_gate_up_silu(norm.tensor(), gu, 8960), dt)
    act = torch.randn(1, 8960, device=DEV, dtype=dt)
    down = torch.randn(1536, 8960, device=DEV, dtype=dt) * 0.01
    assert triton_gemv.supports_add_to(act, down)
    residual = norm.h.clone()
    expected = residual + triton_gemv.skinny_linear(act, down, config=triton_gemv.add_to_config(
        1, 1536, 8960))
    triton_gemv.skinny_linear(act, down, add_to=residual)
    assert torch.equal(residual, expected)


@gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_model_decode_with_the_norms_in_the_gemvs(tmp_path, monkeypatch, graph):
    """A model with Qwen2-1.5B's shapes (random bf16 weights, two layers, qkv bias): its one-row
    decode logits, eager and from the decode CUDA graph, with the residual adds and norms in the
    GEMVs (every layer through `forward_into`, one norm kernel a step: the final one) match those
    of the add + norm kernels (ROLLOUT_NORMS_IN_GEMVS=0) within bf16 rounding, same argmax."""
    from rollout.models import llama
    from rollout.tiny_model import TinyModelSpec, make_tiny_model
    from tests.test_split_sum import decode_logits
    spec = TinyModelSpec(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, dtype="bfloat16")
    path = str(make_tiny_model(tmp_path / "m", spec))
    calls = []
    real = llama.DecoderLayer.forward_into
    monkeypatch.setattr(llama.DecoderLayer, "forward_into",
                        lambda self, *a: calls.append(1) or real(self, *a))
    fused = decode_logits(path, 1, graph)
    assert calls, "forward_into never ran"
    monkeypatch.setattr(llama, "NORMS_IN_GEMVS", False)
    calls.clear()
    plain = decode_logits(path, 1, graph)
    assert not calls
    err = ((fused.float() - plain.float()).norm() / plain.float().norm()).item()
    assert err < 1e-2, err
    assert torch.equal(fused.float().argmax(-1), plain.float().argmax(-1))
