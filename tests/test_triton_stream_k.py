"""Spec: rollout/layers/triton_stream_k.py's stream-K GEMM equals F.linear (and the unfused
silu(gate) * up for the fused gate/up weight) however the K iterations fall on the programs:
tiles whole in one program, cut in two, or spread over several programs (some of which hold no
tile end); ragged M, N and K (TMA zero-fills past the edges); several M blocks; the weight tile
on either side of the MMA (swapped A/B). Every call gives the same bits (partials are added in
program order) and leaves the workspace flags at zero.

On CPU under the Triton interpreter in fp32 (within 1e-5 relative of torch); on a GPU (marked
`gpu`) in bf16 on the Qwen2-1.5B decode shapes with two programs a SM, eager and in a graph."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.layers import triton_gemv, triton_stream_k  # noqa: E402
from rollout.layers.triton_gemv import Config  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_stream_k._stream_k_kernel)


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def flags_zero(device: torch.device) -> bool:
    return bool((triton_stream_k._workspaces[(device.type, device.index)][1] == 0).all())


def sk(block_m, block_n, block_k, swap=False):
    return Config(block_n, block_k, 1, 4, True, 2, block_m, tma=True, swap_ab=swap, stream_k=1)


def run(x, w, bias, gated, cfg, programs):
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return triton_stream_k.launch(x, w, bias, out, gated, cfg, programs=programs)


# (M, N, K, config, programs): 3 programs on 2 x 2 tiles of 3 chunks (whole tiles and cuts),
# 5 on 3 tiles x 7 (cuts in every tile), 7 programs on 1 tile of 7 (one finisher gathering six
# partials), M above block_m (two M blocks) with K not a multiple of block_k, swapped A/B
CASES = [
    (20, 24, 48, sk(16, 16, 16), 3),
    (20, 40, 112, sk(16, 16, 16), 5),
    (3, 16, 112, sk(16, 16, 16), 7),
    (33, 24, 100, sk(16, 16, 16), 4),
    (17, 72, 96, sk(32, 32, 32), 2),
    (20, 40, 112, sk(16, 16, 16, swap=True), 5),
    (33, 24, 100, sk(16, 32, 16, swap=True), 4),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_stream_k_linear_fp32(case):
    m, n, k, cfg, programs = CASES[case]
    x, w, b = rand(m, k, seed=m), rand(n, k, seed=n), rand(n, seed=k)
    for bias in (None, b):
        out = run(x, w, bias, False, cfg, programs)
        assert rel_err(out, F.linear(x, w, bias)) <= 1e-5, bias is not None
        assert torch.equal(out, run(x, w, bias, False, cfg, programs))
        assert flags_zero(x.device)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_stream_k_gate_up_silu_fp32(case):
    m, inter, k, cfg, programs = CASES[case]
    x, w = rand(m, k, seed=m), rand(2 * inter, k, seed=inter)
    out = run(x, w, None, True, cfg, programs)
    gate_up = F.linear(x, w)
    assert out.shape == (m, inter)
    assert rel_err(out, F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) <= 1e-5
    assert torch.equal(out, run(x, w, None, True, cfg, programs))
    assert flags_zero(x.device)


def test_table_entries_dispatch_to_stream_k():
    """A config with `stream_k` set goes to the stream-K kernel through the public entry points
    (its programs a SM times the SMs, never more than there are iterations)."""
    assert triton_stream_k.num_programs(torch.device("cpu"), 2, 5) == 5
    assert triton_stream_k.num_programs(torch.device("cpu"), 1, 99) == triton_stream_k.CPU_SMS
    x, w = rand(20, 48, seed=1), rand(32, 48, seed=2)
    out = triton_gemv.skinny_linear(x, w, config=sk(16, 16, 16))
    assert rel_err(out, F.linear(x, w)) <= 1e-5
    out = triton_gemv.skinny_gate_up_silu(x, w, 16, config=sk(16, 16, 16))
    gate_up = F.linear(x, w)
    assert rel_err(out, F.silu(gate_up[:, :16]) * gate_up[:, 16:]) <= 1e-5


def test_a_grown_workspace_keeps_the_old_one_alive():
    """Captured CUDA graphs keep the workspace pointer they ran with: growing it must not free
    the old buffer."""
    small = triton_stream_k._workspace(DEV, 2, 8)
    programs, floats = 2 * small[1].numel(), 2 * small[0].numel()
    grown = triton_stream_k._workspace(DEV, programs, floats)
    assert grown[0].numel() >= programs * floats and grown[1].numel() >= programs
    assert not grown[1].any()
    assert any(small[0] is old[0] for old in triton_stream_k._outgrown)


# ---- GPU: bf16, Qwen2-1.5B decode shapes, two programs a SM -------------------------------------
QWEN = {"qkv": (2048, 1536, True, False), "gate_up": (17920, 1536, False, True),
        "down": (1536, 8960, False, False)}


@gpu
@pytest.mark.parametrize("name", list(QWEN))
def test_stream_k_bf16_qwen_shapes_in_a_graph(name):
    n, k, has_bias, gated = QWEN[name]
    w = rand(n, k, dtype=torch.bfloat16, seed=1) * k ** -0.5
    bias = rand(n, dtype=torch.bfloat16, seed=2) if has_bias else None
    for m, swap in ((64, False), (128, True), (128, False)):
        cfg = Config(64, 64, 1, 4, True, 3, 64 if swap else 128, tma=True, swap_ab=swap,
                     stream_k=2)
        x = rand(m, k, dtype=torch.bfloat16, seed=m)
        if gated:
            def call():
                return triton_gemv.skinny_gate_up_silu(x, w, n // 2, config=cfg)
            gate_up = F.linear(x, w)
            ref = F.silu(gate_up[:, :n // 2]) * gate_up[:, n // 2:]
        else:
            def call():
                return triton_gemv.skinny_linear(x, w, bias, config=cfg)
            ref = F.linear(x, w, bias)
        eager = call()
        assert rel_err(eager, ref) <= 1e-2, m
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), m
        assert flags_zero(x.device)
