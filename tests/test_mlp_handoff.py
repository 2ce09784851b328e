"""Spec: rollout/layers/mlp_handoff.py — the one-row MLP with down awaiting gate/up's columns
through ready counters gives the plain launches' output bit for bit (the same kernels, configs
and sums), leaves its counters zero, and recovers from counters a lost launch left dirty.

On CPU the kernels run under the Triton interpreter (fp32 and bf16, tiny ragged shapes, down
split along K in 1 to 3, configs put in the tuned table); on a GPU (tests marked `gpu`) the
Qwen2-1.5B shapes in bf16 with the table's configs, eagerly and replayed in a CUDA graph under
PDL, where down's programs do spin on the counters."""
import pytest
import torch

pytest.importorskip("triton")

from rollout.layers import mlp_handoff, triton_gemv, triton_ops  # noqa: E402
from rollout.layers.split_sum import SplitSum  # noqa: E402
from rollout.layers.triton_gemv import Config  # noqa: E402
from tests.helpers import DEV, gpu, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_gemv._gemv_fma_kernel)


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEV, dtype=dtype)


def plain_mlp(x, w_gate_up, w_down):
    """The two launches the hand-off replaces (MLP.forward's path without it)."""
    inter = w_gate_up.shape[0] // 2
    h = triton_gemv.skinny_gate_up_silu(x, w_gate_up, inter)
    return triton_gemv.skinny_linear(h, w_down, defer_split=True)


def use_configs(monkeypatch, hidden, inter, out, gate_up: Config, down: Config):
    monkeypatch.setitem(triton_gemv._TUNED, (1, 2 * inter, hidden, True), gate_up)
    monkeypatch.setitem(triton_gemv._TUNED, (1, out, inter, False), down)


def add_norm(split, seed=9):
    """The reader after the MLP in a layer: the residual add + RMSNorm summing the partials."""
    n = split.shape[1]
    residual = rand(1, n, dtype=split.dtype, seed=seed)
    weight = rand(n, dtype=split.dtype, seed=seed + 1)
    return triton_ops.split_add_rms_norm(split, residual, weight, 1e-6)


CASES = {  # hidden, inter, out, gate/up config, down config
    "split2": (64, 96, 48, Config(4, 32), Config(8, 16, 2, preload=2, lookahead=True)),
    # ragged: inter 100 = 6.25 chunks of 16, the last split's range past K; 3 splits
    "ragged_split3": (48, 100, 40, Config(4, 16, preload=2), Config(8, 16, 3, preload=3)),
    "split4_chunks_of_32": (32, 256, 24, Config(8, 32), Config(8, 32, 4, lookahead=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_plain_launches_and_its_reader_zeroes_the_counters(monkeypatch, case, dtype):
    hidden, inter, out, gate_up_cfg, down_cfg = CASES[case]
    use_configs(monkeypatch, hidden, inter, out, gate_up_cfg, down_cfg)
    w_gate_up = rand(2 * inter, hidden, dtype=dtype, seed=1, scale=hidden ** -0.5)
    w_down = rand(out, inter, dtype=dtype, seed=2, scale=inter ** -0.5)
    counters = mlp_handoff.HandoffCounters()
    chunks = -(-inter // down_cfg.block_k)
    for seed in (3, 4):  # the second call reuses the counters the first call's reader zeroed
        x = rand(1, hidden, dtype=dtype, seed=seed)
        got = mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)
        want = plain_mlp(x, w_gate_up, w_down)
        assert isinstance(got, SplitSum) and got.reset is counters
        assert torch.equal(got.partials, want.partials)
        # the counters hold each chunk's width until the reader zeroes them
        full = counters.tensor[:chunks * triton_gemv.HANDOFF_STRIDE.value:
                               triton_gemv.HANDOFF_STRIDE.value]
        widths = [min(down_cfg.block_k, inter - c * down_cfg.block_k) for c in range(chunks)]
        assert full.tolist() == widths and counters.pending
        if seed == 3:
            got_norm, want_norm = add_norm(got), add_norm(want)
            assert all(torch.equal(g, w) for g, w in zip(got_norm, want_norm))
        else:
            assert torch.equal(got.tensor(), want.tensor())
        assert not counters.tensor.any() and not counters.pending


def test_counters_left_full_are_zeroed_by_the_next_call(monkeypatch):
    """A result never read (or a down lost to a host error) leaves the counters full: on a GPU
    the next down would read a stale intermediate at once; the next call zeroes them first."""
    hidden, inter, out, gate_up_cfg, down_cfg = CASES["split2"]
    use_configs(monkeypatch, hidden, inter, out, gate_up_cfg, down_cfg)
    w_gate_up = rand(2 * inter, hidden, seed=1, scale=0.1)
    w_down = rand(out, inter, seed=2, scale=0.1)
    counters = mlp_handoff.HandoffCounters()
    mlp_handoff.one_row_mlp(rand(1, hidden, seed=5), w_gate_up, w_down, counters)  # never read
    assert counters.pending and counters.tensor.any()
    x = rand(1, hidden, seed=3)
    got = mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)
    assert torch.equal(got.tensor(), plain_mlp(x, w_gate_up, w_down).tensor())
    assert not counters.tensor.any()


def test_configs_that_cannot_hand_off(monkeypatch):
    """gate/up split along K (its sums are not final in one program), a gate/up program's
    columns across two chunks of down, a tensor-core config, down unsplit (no partials for the
    norm, which zeroes the counters): no hand-off."""
    hidden, inter, out = 64, 96, 48
    cases = [(Config(4, 32, 2), Config(8, 16, 2)),
             (Config(32, 32), Config(8, 16, 2)),
             (Config(4, 32), Config(16, 16, 2, dot=True)),
             (Config(4, 32), Config(8, 16, 1))]
    for gate_up_cfg, down_cfg in cases:
        use_configs(monkeypatch, hidden, inter, out, gate_up_cfg, down_cfg)
        assert mlp_handoff._configs(hidden, inter, out) is None
    use_configs(monkeypatch, hidden, inter, out, Config(4, 32), Config(8, 16, 2))
    assert mlp_handoff._configs(hidden, inter, out)[2] == 16


# ---- GPU: the Qwen2-1.5B shapes with the tuned table ------------------------------------------
QWEN = dict(hidden=1536, inter=8960)


def qwen_weights():
    h, i = QWEN["hidden"], QWEN["inter"]
    return (rand(2 * i, h, dtype=torch.bfloat16, seed=1, scale=h ** -0.5),
            rand(h, i, dtype=torch.bfloat16, seed=2, scale=i ** -0.5))


@gpu
def test_gpu_applies_with_the_table():
    w_gate_up, w_down = qwen_weights()
    x = rand(1, QWEN["hidden"], dtype=torch.bfloat16)
    assert mlp_handoff.applies(x, w_gate_up, w_down)
    assert not mlp_handoff.applies(rand(2, QWEN["hidden"], dtype=torch.bfloat16), w_gate_up, w_down)


@gpu
def test_gpu_eager_calls_back_to_back():
    """Fifty MLP + add-norm pairs queued without a sync (each down spins while its gate/up runs
    under PDL; each norm zeroes the counters for the next)."""
    w_gate_up, w_down = qwen_weights()
    counters = mlp_handoff.HandoffCounters()
    xs = [rand(1, QWEN["hidden"], dtype=torch.bfloat16, seed=s) for s in range(50)]
    got = [add_norm(mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)) for x in xs]
    torch.cuda.synchronize()
    for x, g in zip(xs, got):
        want = add_norm(plain_mlp(x, w_gate_up, w_down))
        assert all(torch.equal(a, b) for a, b in zip(g, want))
    assert not counters.tensor.any()


@gpu
def test_gpu_cuda_graph_replays():
    """Captured as in a layer (each MLP read by the add-norm), four in a row on one set of
    counters, replayed 20 times on new inputs: the plain launches' bits every time."""
    w_gate_up, w_down = qwen_weights()
    counters = mlp_handoff.HandoffCounters()
    x = rand(1, QWEN["hidden"], dtype=torch.bfloat16)
    for _ in range(2):  # compile and make the counters outside the capture
        add_norm(mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [add_norm(mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters))[0]
                for _ in range(4)]
    for seed in range(20):
        x.copy_(rand(1, QWEN["hidden"], dtype=torch.bfloat16, seed=100 + seed))
        graph.replay()
        torch.cuda.synchronize()
        want = add_norm(plain_mlp(x, w_gate_up, w_down))[0]
        assert all(torch.equal(o, want) for o in outs), seed
        assert not counters.tensor.any()
