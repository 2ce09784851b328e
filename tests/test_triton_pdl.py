"""Spec for programmatic dependent launch (rollout/triton_pdl.py): on a Hopper-or-newer GPU our
Triton kernels launch with PDL by default, and a chain of them — each reading what the previous
one wrote, temporaries reused by the caching allocator — gives bit for bit the results of the
same chain launched without it, eagerly and inside a CUDA graph. Off the GPU (and under the
interpreter) PDL is off and the kernels take USE_PDL=False."""
import pytest
import torch

pytest.importorskip("triton")

from rollout import triton_pdl  # noqa: E402
from tests.helpers import gpu  # noqa: E402


def test_off_without_a_hopper_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("a Hopper-or-newer GPU is present")
    assert not triton_pdl.enabled()
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
def test_pdl_chain_equals_the_plain_chain_eager_and_in_a_graph(monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    assert triton_pdl.enabled()
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
