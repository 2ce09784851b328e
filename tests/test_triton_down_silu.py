"""Spec: rollout/layers/triton_down_silu.py — the down GEMM with silu(gate) · up in its prologue
equals the unfused path: silu_and_mul on the plain gate/up output, then the GEMM.

On CPU under the Triton interpreter in fp32 on tiny ragged shapes (M and N past the tiles, I not
a multiple of the K chunk, splits whose last range runs past I), plain and swapped tiles: within
1e-5 relative of F.linear(silu(gate) · up, W), and bit for bit the TMA GEMM of silu_and_mul's
output with the same config. On a GPU (`gpu`): bf16 at the Qwen2-1.5B MLP shape, the same bits as
triton_gemm_tma on silu_and_mul's output, in eager and in a CUDA graph."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from rollout.layers import triton_down_silu, triton_gemm_tma, triton_ops  # noqa: E402
from rollout.layers.split_sum import SplitSum  # noqa: E402
from rollout.layers.triton_gemv import Config  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_down_silu._down_silu_kernel)


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference(gate_up, w):
    inter = w.shape[1]
    return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w)


CONFIGS = {
    "plain": Config(16, 32, dot=True, block_m=16, tma=True),
    "swap": Config(16, 32, dot=True, block_m=16, tma=True, swap_ab=True),
    "split": Config(16, 16, 3, dot=True, block_m=16, tma=True),
    "swap_split": Config(32, 16, 2, dot=True, num_stages=4, block_m=16, tma=True, swap_ab=True),
}


def summed(out):
    return out.tensor() if isinstance(out, SplitSum) else out


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("rows,inter,n", [(5, 48, 40), (19, 40, 24)])
def test_down_silu_equals_silu_then_gemm(name, rows, inter, n):
    cfg = CONFIGS[name]
    gate_up, w = rand(rows, 2 * inter, seed=1), rand(n, inter, seed=2) * inter ** -0.5
    out = triton_down_silu.down_silu(gate_up, w, cfg)
    assert out.shape == (rows, n) and out.dtype == gate_up.dtype
    assert rel_err(out, reference(gate_up, w)) < 1e-5
    act = triton_ops.silu_and_mul(gate_up)
    same = triton_gemm_tma.launch(act, w, None, torch.empty(rows, n, device=DEV), False, cfg)
    assert torch.equal(out, same)


@pytest.mark.parametrize("name", ["split", "swap_split"])
def test_down_silu_defers_its_split_partials(name):
    """Split along K with defer_split: a SplitSum whose sum is the reduced output, bit for bit."""
    cfg = CONFIGS[name]
    gate_up, w = rand(7, 96, seed=3), rand(24, 48, seed=4)
    deferred = triton_down_silu.down_silu(gate_up, w, cfg, defer_split=True)
    assert isinstance(deferred, SplitSum) and deferred.partials.shape[0] == cfg.split_k
    assert torch.equal(summed(deferred), triton_down_silu.down_silu(gate_up, w, cfg))


def test_down_silu_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"not \[M, 2·I\]"):
        triton_down_silu.down_silu(rand(4, 50), rand(8, 24), CONFIGS["plain"])
    with pytest.raises(ValueError, match="dtype|float"):
        triton_down_silu.down_silu(rand(4, 48), rand(8, 24, dtype=torch.float64),
                                   CONFIGS["plain"])
    with pytest.raises(ValueError, match="16-byte aligned"):  # I = 6 fp32: 24-byte half rows
        triton_down_silu.down_silu(rand(4, 12), rand(8, 6), CONFIGS["plain"])


# ---- GPU: bf16 at the Qwen2-1.5B MLP (hidden 1,536, intermediate 8,960) -------------------------
GPU_CONFIGS = {  # a decode batch's swapped split tiles, and a prefill chunk's wide ones
    128: Config(64, 128, 5, 4, True, 4, 128, tma=True, swap_ab=True, prefetch_k=512),
    64: Config(64, 128, 5, 4, True, 4, 64, tma=True),
    1000: Config(128, 64, 1, 8, True, 4, 128, tma=True),
}


@gpu
@pytest.mark.parametrize("rows", sorted(GPU_CONFIGS))
def test_gpu_down_silu_bits_and_graph(rows):
    """The same bits as the TMA GEMM of silu_and_mul's output (same config), within 1e-2 of
    cuBLAS's down(silu(gate) · up), and replayed in a CUDA graph bit for bit as eager."""
    cfg = GPU_CONFIGS[rows]
    gate_up = rand(rows, 2 * 8960, dtype=torch.bfloat16, seed=rows)
    w = rand(1536, 8960, dtype=torch.bfloat16, seed=2) * 8960 ** -0.5
    eager = triton_down_silu.down_silu(gate_up, w, cfg)
    act = triton_ops.silu_and_mul(gate_up)
    assert torch.equal(eager, triton_gemm_tma.launch(act, w, None, torch.empty_like(eager),
                                                     False, cfg))
    assert rel_err(eager, F.linear(act, w)) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = summed(triton_down_silu.down_silu(gate_up, w, cfg, defer_split=True))
    graph.replay()
    assert torch.equal(out, eager)


@gpu
def test_gpu_mlp_takes_down_silu_where_the_table_lists_it(monkeypatch):
    """The decoder's MLP at rows with a `_DOWN_SILU` entry runs plain gate/up + down_silu (its
    output is that composition's, bit for bit) and off the entry the fused gate/up path; both
    within 1e-2 of HF's MLP."""
    from transformers.activations import ACT2FN
    from rollout.distributed import SINGLE
    from rollout.layers import gemv_launch
    from rollout.models.llama import MLP
    mlp = MLP(SimpleNamespace(hidden_size=1536, intermediate_size=8960), SINGLE).to(
        device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(rand(2 * 8960, 1536, dtype=torch.bfloat16) * 1536 ** -0.5)
        mlp.down_proj.weight.copy_(rand(1536, 8960, dtype=torch.bfloat16, seed=3)
                                   * 8960 ** -0.5)
    x = rand(128, 1536, dtype=torch.bfloat16, seed=4)
    gu = F.linear(x, mlp.gate_up_proj.weight)
    hf = F.linear(ACT2FN["silu"](gu[:, :8960]) * gu[:, 8960:], mlp.down_proj.weight)
    monkeypatch.setitem(gemv_launch._DOWN_SILU, (128, 1536, 8960), GPU_CONFIGS[128])
    with torch.no_grad():
        fused = summed(mlp(x))
        composed = triton_down_silu.down_silu(gu, mlp.down_proj.weight, GPU_CONFIGS[128])
    assert torch.equal(fused, composed) and rel_err(fused, hf) <= 1e-2
    monkeypatch.setitem(gemv_launch._DOWN_SILU, (128, 1536, 8960), None)
    with torch.no_grad():
        other = summed(mlp(x))
    assert not torch.equal(other, fused) and rel_err(other, hf) <= 1e-2
