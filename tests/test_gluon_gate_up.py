"""The Gluon one-row gate/up + SiLU (rollout/layers/gluon_gate_up.py, experimental): on an H200
only — Gluon does not run under the CPU interpreter. Oracle: F.linear + silu · up (each GEMM
output rounded to bf16, as the unfused path) and the Triton kernel it would replace; every
config of the sweep, eager, in a CUDA graph under PDL, and with a ragged group count per
program."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.helpers import gpu  # noqa: E402

CONFIGS = [(4, 8, 4, 1, 0), (4, 4, 4, 2, 0), (4, 3, 4, 3, 0), (8, 4, 8, 1, 0), (8, 2, 8, 2, 0),
           (2, 8, 2, 2, 0), (4, 8, 4, 1, 1)]


def _inputs(inter: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(2 * inter, k, generator=g, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(1, k, generator=g, device="cuda").to(torch.bfloat16)
    return x, w


def _reference(x, w, inter):
    gate_up = F.linear(x, w)
    return (F.silu(gate_up[:, :inter]) * gate_up[:, inter:])


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@gpu
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("shape", [(8960, 1536), (1000, 512), (36, 256)])
def test_gluon_gate_up_matches_torch(cfg, shape):
    from rollout.layers import gluon_gate_up, triton_gemv
    config = gluon_gate_up.GluonGateUpConfig(*cfg[:4], bool(cfg[4]))
    inter, k = shape
    if inter % config.rows:
        pytest.skip("inter not a multiple of the group")
    x, w = _inputs(inter, k, seed=inter + k)
    out = gluon_gate_up.gate_up_silu(x, w, inter, config)
    ref = _reference(x, w, inter)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 1e-2
    triton_out = triton_gemv.skinny_gate_up_silu(x, w, inter)
    # same sums in another order: within a few bf16 roundings of the Triton kernel, elementwise
    assert torch.allclose(out.float(), triton_out.float(), rtol=2e-2, atol=2e-3)


@gpu
def test_gluon_gate_up_in_graph_under_pdl():
    """Captured behind the RMSNorm that writes its input, under PDL (the kernel's weight copies
    start before its wait), replayed with new inputs: the eager bits each time."""
    from rollout import pdl_policy
    from rollout.layers import gluon_gate_up, triton_ops
    config = gluon_gate_up.GluonGateUpConfig()
    inter, k = 8960, 1536
    x, w = _inputs(inter, k, seed=1)
    norm_w = torch.rand(k, device="cuda").to(torch.bfloat16) + 0.5
    static_x, h = x.clone(), torch.empty_like(x)

    def step():
        triton_ops.rms_norm(static_x, norm_w, 1e-6, out=h)
        return gluon_gate_up.gate_up_silu(h, w, inter, config)

    with pdl_policy.decode_forward():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    for seed in (2, 3):
        new_x, _ = _inputs(inter, k, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        normed = triton_ops.rms_norm(new_x, norm_w, 1e-6)
        eager = gluon_gate_up.gate_up_silu(normed, w, inter, config)
        assert torch.equal(out, eager)
        assert _rel(out, _reference(normed, w, inter)) <= 1e-2
