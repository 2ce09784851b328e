"""Spec: a prefill chunk's gate/up + SiLU by the persistent Gluon GEMM
(rollout/layers/gluon_prefill_gemm.py) where `linear.prefill_gate_up_silu` sends it.

Gluon has no interpreter, so on CPU the spec covers the dispatch (None — cuBLAS + SiLU — off a
Hopper GPU, below PREFILL_GLUON_MIN_ROWS, for other dtypes or with the switch off) and the kernel
compiled for sm_90 (a stub driver naming an H200). On the H200 (`gpu`): the same bits as cuBLAS +
silu_and_mul on ragged shapes (rows past the last x tile, output columns past the last weight
tile, K past the last chunk), whatever the number of programs (one program running every tile,
so its ring wraps around many times; a few; one an SM), eagerly and in a CUDA graph; and the
MLP at a chunk's rows taking it, with the bits of cuBLAS + SiLU."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.layers import linear  # noqa: E402
from tests.helpers import H200CompileTarget, gpu  # noqa: E402

INTER, HIDDEN = 8960, 1536


def _module():
    try:
        from rollout.layers import gluon_prefill_gemm
    except ImportError:
        pytest.skip("this Triton has no Gluon Hopper module")
    return gluon_prefill_gemm


def test_dispatch_declines_where_the_kernel_does_not_serve(monkeypatch):
    """None (the caller's cuBLAS + SiLU) on the CPU, for float32 rows, below the row threshold
    and with ROLLOUT_PREFILL_GLUON=0 — before touching Triton."""
    rows = linear.PREFILL_GLUON_MIN_ROWS
    w = torch.zeros(2 * 64, 32, dtype=torch.bfloat16)
    assert linear.prefill_gate_up_silu(torch.zeros(rows, 32, dtype=torch.bfloat16), w, 64) is None
    assert linear.prefill_gate_up_silu(torch.zeros(rows, 32), w.float(), 64) is None
    if torch.cuda.is_available():
        cuda_w = w.cuda()
        assert linear.prefill_gate_up_silu(
            torch.zeros(rows - 1, 32, dtype=torch.bfloat16, device="cuda"), cuda_w, 64) is None
        monkeypatch.setattr(linear, "PREFILL_GLUON", False)
        assert linear.prefill_gate_up_silu(
            torch.zeros(rows, 32, dtype=torch.bfloat16, device="cuda"), cuda_w, 64) is None


def test_launch_args_refuse_a_k_split_and_clamp_the_grid():
    g = _module()
    x = torch.empty(300, HIDDEN, dtype=torch.bfloat16)
    w = torch.empty(2 * INTER, HIDDEN, dtype=torch.bfloat16)
    y = torch.empty(300, INTER, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no K split"):
        g._launch_args(x, w, y, True, g.CONFIG._replace(split_k=2), 132)
    tiles = 3 * 70  # 300 rows in 128-row tiles, 8,960 gate rows in 128-row tiles
    assert g._launch_args(x, w, y, True, g.CONFIG, 132)[0] == (132,)
    assert g._launch_args(x, w, y, True, g.CONFIG, 1000)[0] == (tiles,)


@pytest.mark.parametrize("stages", [4, 3])
def test_compiles_for_sm90(stages):
    """The launch compiles to wgmma with the warps split (setmaxnreg) and fits an SM's shared
    memory; no PDL wait (a prefill's kernels do not take the decode chain's early launch)."""
    g = _module()
    from triton.runtime import driver
    x = torch.empty(8192, HIDDEN, dtype=torch.bfloat16)
    w = torch.empty(2 * INTER, HIDDEN, dtype=torch.bfloat16)
    y = torch.empty(8192, INTER, dtype=torch.bfloat16)
    previous = driver._active
    driver.set_active(H200CompileTarget())
    try:
        kernel = g.compile_for_sm90(x, w, y, True, g.CONFIG._replace(num_stages=stages))
    finally:
        driver._active = previous
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg" in ptx and ptx.count("wgmma.mma_async") > 0
    assert "griddepcontrol" not in ptx
    assert kernel.metadata.shared <= 232448  # 227 KB: one program an SM


# ---- on the H200 -----------------------------------------------------------------------------
def rand(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)


def reference(x, w):
    from rollout.layers import triton_ops
    return triton_ops.silu_and_mul(F.linear(x, w))


def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is Hopper's (wgmma)")
    return _module()


@gpu
@pytest.mark.parametrize("rows,inter,k", [(8256, INTER, HIDDEN), (1000, 1000, HIDDEN),
                                          (700, 200, 1000)])
def test_gpu_same_bits_as_cublas_silu_on_ragged_shapes(rows, inter, k):
    """Rows past the last x tile (8,256 = 64 x 128 + 64: the mixed step of batch 128's second
    chunk), output columns past the last weight tile (1,000 = 7 x 128 + 104), K past the last
    chunk of 64 (zero-filled by TMA); against cuBLAS + silu_and_mul, the same bits."""
    g = _hopper()
    w = rand(2 * inter, k, seed=3) * k ** -0.5
    x = rand(rows, k, seed=rows)
    out = torch.full((rows, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    g.launch(x, w, out, True, g.CONFIG)
    torch.testing.assert_close(out, reference(x, w), rtol=0, atol=0)


@gpu
def test_gpu_programs_and_stages_give_the_same_bits_eager_and_in_a_graph():
    """One program running all 140 tiles (its ring of 4 stages wraps 840 times), 7 programs
    (tiles 20 each), one an SM; 3 or 4 stages; 64-row weight tiles: one output, and the same
    from a CUDA graph's replay."""
    g = _hopper()
    w = rand(2 * INTER, HIDDEN, seed=7) * HIDDEN ** -0.5
    x = rand(256, HIDDEN, seed=8)
    ref = reference(x, w)
    out = torch.empty_like(ref)
    for programs in (1, 7, None):
        for cfg in (g.CONFIG, g.CONFIG._replace(num_stages=3), g.CONFIG._replace(block_n=64)):
            out.fill_(float("nan"))
            g.launch(x, w, out, True, cfg, programs)
            assert torch.equal(out, ref), (programs, cfg)
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.launch(x, w, out, True, g.CONFIG)
    graph.replay()
    assert torch.equal(out, ref)


@gpu
def test_gpu_the_mlp_takes_it_at_a_chunks_rows_with_the_same_bits(monkeypatch):
    """Qwen2-1.5B's MLP (bf16) on a chunk of 8,256 rows: its activation through the kernel
    (`linear.prefill_gate_up_silu` takes it) and, switched off, through cuBLAS + SiLU give the
    same bits."""
    _hopper()
    from types import SimpleNamespace

    from rollout.distributed import SINGLE
    from rollout.models.llama import MLP
    mlp = MLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER), SINGLE)
    mlp = mlp.to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(rand(2 * INTER, HIDDEN, seed=20) * HIDDEN ** -0.5)
    x = rand(8256, HIDDEN, seed=21)
    taken = []
    real = linear.prefill_gate_up_silu

    def spy(*args):
        out = real(*args)
        taken.append(out is not None)
        return out
    monkeypatch.setattr("rollout.models.llama.prefill_gate_up_silu", spy)
    with torch.no_grad():
        fused = mlp.activation_cuda(x)
        monkeypatch.setattr(linear, "PREFILL_GLUON", False)
        plain = mlp.activation_cuda(x)
    assert taken == [True, False]
    assert torch.equal(fused, plain)
