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

from rollout.layers import mlp_handoff, triton_gemv  # noqa: E402
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


def as_parts(result):
    """A result's tensors, to compare bit for bit (a SplitSum: its partials)."""
    return result.partials if isinstance(result, SplitSum) else result


def use_configs(monkeypatch, hidden, inter, out, gate_up: Config, down: Config):
    monkeypatch.setitem(triton_gemv._TUNED, (1, 2 * inter, hidden, True), gate_up)
    monkeypatch.setitem(triton_gemv._TUNED, (1, out, inter, False), down)


CASES = {  # hidden, inter, out, gate/up config, down config
    "split2": (64, 96, 48, Config(4, 32), Config(8, 16, 2, preload=2, lookahead=True)),
    # ragged: inter 100 = 6.25 chunks of 16, the last split's range past K; 3 splits
    "ragged_split3": (48, 100, 40, Config(4, 16, preload=2), Config(8, 16, 3, preload=3)),
    "unsplit": (32, 64, 24, Config(8, 32), Config(8, 16, 1, lookahead=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_plain_launches_and_zeroes_its_counters(monkeypatch, case, dtype):
    hidden, inter, out, gate_up_cfg, down_cfg = CASES[case]
    use_configs(monkeypatch, hidden, inter, out, gate_up_cfg, down_cfg)
    w_gate_up = rand(2 * inter, hidden, dtype=dtype, seed=1, scale=hidden ** -0.5)
    w_down = rand(out, inter, dtype=dtype, seed=2, scale=inter ** -0.5)
    counters = mlp_handoff.HandoffCounters()
    for seed in (3, 4):  # the second call reuses the counters the first zeroed
        x = rand(1, hidden, dtype=dtype, seed=seed)
        got = mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)
        want = plain_mlp(x, w_gate_up, w_down)
        assert type(got) is type(want)
        assert torch.equal(as_parts(got), as_parts(want))
        assert counters.tensor.shape == (down_cfg.split_k + 1,)
        assert not counters.tensor.any() and not counters.pending


def test_dirty_counters_of_a_lost_launch_are_zeroed_first(monkeypatch):
    hidden, inter, out, gate_up_cfg, down_cfg = CASES["split2"]
    use_configs(monkeypatch, hidden, inter, out, gate_up_cfg, down_cfg)
    w_gate_up = rand(2 * inter, hidden, seed=1, scale=0.1)
    w_down = rand(out, inter, seed=2, scale=0.1)
    x = rand(1, hidden, seed=3)
    counters = mlp_handoff.HandoffCounters()
    mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)
    # a gate/up that ran without its down: its adds stay (full counters would let down read
    # a stale intermediate at once on a GPU; here they would reach 2x the target)
    counters.tensor.fill_(inter)
    counters.pending = True
    got = mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)
    assert torch.equal(as_parts(got), as_parts(plain_mlp(x, w_gate_up, w_down)))
    assert not counters.tensor.any()


def test_configs_that_cannot_hand_off(monkeypatch):
    """gate/up split along K (its sums are not final in one program), a gate/up program's
    columns across two of down's splits, and a tensor-core config: no hand-off."""
    hidden, inter, out = 64, 96, 48
    cases = [(Config(4, 32, 2), Config(8, 16, 2)),
             (Config(32, 32), Config(8, 16, 2)),  # down's split covers 48 columns, not 32's multiple
             (Config(4, 32), Config(16, 16, 2, dot=True))]
    for gate_up_cfg, down_cfg in cases:
        use_configs(monkeypatch, hidden, inter, out, gate_up_cfg, down_cfg)
        assert mlp_handoff._configs(hidden, inter, out) is None
    use_configs(monkeypatch, hidden, inter, out, Config(4, 32), Config(8, 16, 2))
    assert mlp_handoff._configs(hidden, inter, out)[2] == 48


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
    """Fifty calls queued without a sync (each down spins while its gate/up runs under PDL)."""
    w_gate_up, w_down = qwen_weights()
    counters = mlp_handoff.HandoffCounters()
    xs = [rand(1, QWEN["hidden"], dtype=torch.bfloat16, seed=s) for s in range(50)]
    got = [as_parts(mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)).clone() for x in xs]
    torch.cuda.synchronize()
    for x, g in zip(xs, got):
        assert torch.equal(g, as_parts(plain_mlp(x, w_gate_up, w_down)))
    assert not counters.tensor.any()


@gpu
def test_gpu_cuda_graph_replays():
    """Captured (with a norm-like kernel before it, as in a layer), replayed 20 times on new
    inputs: the plain launches' bits every time, the counters zero after."""
    w_gate_up, w_down = qwen_weights()
    counters = mlp_handoff.HandoffCounters()
    x = rand(1, QWEN["hidden"], dtype=torch.bfloat16)
    for _ in range(2):  # compile and make the counters outside the capture
        mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [as_parts(mlp_handoff.one_row_mlp(x, w_gate_up, w_down, counters))
                for _ in range(4)]  # four MLPs in a row on one set of counters
    for seed in range(20):
        x.copy_(rand(1, QWEN["hidden"], dtype=torch.bfloat16, seed=100 + seed))
        graph.replay()
        torch.cuda.synchronize()
        want = as_parts(plain_mlp(x, w_gate_up, w_down))
        assert all(torch.equal(o, want) for o in outs), seed
        assert not counters.tensor.any()
