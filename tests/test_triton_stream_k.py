"""Spec: rollout/layers/triton_stream_k.py's stream-K GEMM equals F.linear (and the unfused
silu(gate) * up for the fused gate/up weight) however the K iterations fall on the programs:
tiles whole in one program, cut in two, or spread over several programs (some of which hold no
tile end); ragged M, N and K; several M blocks. Every call gives the same bits (partials are
added in program order) and leaves the workspace flags at zero.

On CPU under the Triton interpreter in fp32 (within 1e-5 relative of torch); on a GPU (marked
`gpu`) in bf16 on the Qwen2-1.5B decode shapes with one program a SM, eager and in a CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.layers import triton_gemv, triton_stream_k  # noqa: E402
from rollout.layers.triton_stream_k import StreamKConfig  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_stream_k._stream_k_kernel)


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def flags_zero(device: torch.device) -> bool:
    return bool((triton_stream_k._workspaces[(device.type, device.index)][1] == 0).all())


# (M, N, K, config): iterations a program vs a tile's: 3 programs on 12 x 2 (whole tiles and
# halves), 5 on 3 tiles x 7 (cuts in every tile), 7 programs on 1 tile of 7 (one finisher
# gathering six partials), M above block_m (two M blocks), K not a multiple of block_k
CASES = [
    (5, 24, 48, StreamKConfig(16, 8, 16, 4, 2, programs=3)),
    (20, 40, 112, StreamKConfig(16, 16, 16, 4, 2, programs=5)),
    (3, 16, 112, StreamKConfig(16, 16, 16, 4, 2, programs=7)),
    (33, 24, 100, StreamKConfig(16, 16, 16, 4, 2, programs=4)),
    (17, 72, 96, StreamKConfig(32, 32, 32, 4, 2, programs=2)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_stream_k_linear_fp32(case):
    m, n, k, cfg = CASES[case]
    x, w, b = rand(m, k, seed=m), rand(n, k, seed=n), rand(n, seed=k)
    for bias in (None, b):
        out = triton_gemv.skinny_linear(x, w, bias, config=cfg)
        assert rel_err(out, F.linear(x, w, bias)) <= 1e-5, bias is not None
        assert torch.equal(out, triton_gemv.skinny_linear(x, w, bias, config=cfg))
        assert flags_zero(x.device)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_stream_k_gate_up_silu_fp32(case):
    m, inter, k, cfg = CASES[case]
    x, w = rand(m, k, seed=m), rand(2 * inter, k, seed=inter)
    out = triton_gemv.skinny_gate_up_silu(x, w, inter, config=cfg)
    gate_up = F.linear(x, w)
    assert out.shape == (m, inter)
    assert rel_err(out, F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) <= 1e-5
    assert torch.equal(out, triton_gemv.skinny_gate_up_silu(x, w, inter, config=cfg))
    assert flags_zero(x.device)


def test_programs_never_exceed_the_iterations():
    # 1 tile of 2 iterations: 2 programs at most, whatever the config asks
    assert triton_stream_k.num_programs(DEV, StreamKConfig(programs=8), 2) == 2
    x, w = rand(4, 32), rand(8, 32)
    out = triton_gemv.skinny_linear(x, w, config=StreamKConfig(16, 16, 16, 4, 2, programs=8))
    assert rel_err(out, F.linear(x, w)) <= 1e-5


def test_a_grown_workspace_keeps_the_old_one_alive():
    """Captured CUDA graphs keep the workspace pointer they ran with: growing it must not free
    the old buffer."""
    small = triton_stream_k._workspace(DEV, 2, 8)
    programs, floats = 2 * small[1].numel(), 2 * small[0].numel()
    grown = triton_stream_k._workspace(DEV, programs, floats)
    assert grown[0].numel() >= programs * floats and grown[1].numel() >= programs
    assert not grown[1].any()
    assert any(small[0] is old[0] for old in triton_stream_k._outgrown)


def test_config_files_name_stream_k_entries(tmp_path):
    path = tmp_path / "configs.json"
    path.write_text('[{"M": 256, "N": 999, "K": 77, "gated": false, "config": {"stream_k": true, '
                    '"block_m": 64, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 3}}]')
    try:
        assert triton_gemv.load_tuned(str(path)) == 1
        assert triton_gemv._config(200, 999, 77) == StreamKConfig(64, 32, 64, 4, 3)
    finally:
        triton_gemv._TUNED.pop((256, 999, 77, False))


# ---- GPU: bf16, Qwen2-1.5B decode shapes, one program a SM ---------------------------------------
QWEN = {"qkv": (2048, 1536, True, False), "o": (1536, 1536, False, False),
        "gate_up": (17920, 1536, False, True), "down": (1536, 8960, False, False)}


@gpu
@pytest.mark.parametrize("name", list(QWEN))
def test_stream_k_bf16_qwen_shapes_in_a_graph(name):
    n, k, has_bias, gated = QWEN[name]
    w = rand(n, k, dtype=torch.bfloat16, seed=1) * k ** -0.5
    bias = rand(n, dtype=torch.bfloat16, seed=2) if has_bias else None
    for m in (17, 64, 128, 200):
        cfg = StreamKConfig(128 if m > 64 else 64, 64, 64, 8, 3)
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
