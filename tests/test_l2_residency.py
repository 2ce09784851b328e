"""Spec: rollout/l2_residency.py — which weights are kept in the L2 (kinds in order, within the
budget), the settings' validation, and that the eviction policy a GEMV loads its weight with
changes no bit of its output (under the interpreter on CPU; compiled where a GPU runs this
file)."""
import pytest
import torch

from rollout import l2_residency
from rollout.l2_residency import L2Settings, choose

W = lambda rows: torch.empty(rows, 4)  # noqa: E731  (4 columns of fp32: 16 bytes a row)
NAMED = [("model.layers.0.self_attn.qkv_proj.weight", W(8)),
         ("model.layers.0.self_attn.o_proj.weight", W(4)),
         ("model.layers.0.mlp.down_proj.weight", W(4)),
         ("model.layers.1.self_attn.qkv_proj.weight", W(8)),
         ("model.layers.1.self_attn.o_proj.weight", W(4))]


def test_choose_takes_kinds_in_order_within_the_budget():
    # o_proj first (64 B each, both layers), then qkv_proj (128 B) while it fits
    assert choose(NAMED, ("o_proj", "qkv_proj"), 256) == [
        "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight",
        "model.layers.0.self_attn.qkv_proj.weight"]
    assert choose(NAMED, ("qkv_proj",), 127) == []
    assert choose(NAMED, ("down_proj", "o_proj"), 10**6) == [
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.self_attn.o_proj.weight"]
    assert choose(NAMED, ("proj",), 10**6) == []  # a module's name, not a substring


def test_settings_from_env_and_their_errors():
    s = L2Settings.from_env({"ROLLOUT_L2_RESIDENT_MB": "32", "ROLLOUT_L2_RESIDENT_KINDS": "o_proj, down_proj",
                             "ROLLOUT_L2_STREAM": "evict_first"})
    assert s == L2Settings(32.0, ("o_proj", "down_proj"), "evict_first")
    assert L2Settings.from_env({}) == L2Settings()
    with pytest.raises(ValueError, match="ROLLOUT_L2_RESIDENT_MB"):
        L2Settings.from_env({"ROLLOUT_L2_RESIDENT_MB": "lots"})
    with pytest.raises(ValueError, match="ROLLOUT_L2_RESIDENT_MB"):
        L2Settings(-1.0)
    with pytest.raises(ValueError, match="ROLLOUT_L2_STREAM"):
        L2Settings(stream="evict_last")


def test_apply_is_off_without_a_budget_or_a_gpu():
    model = torch.nn.Linear(4, 4)
    assert l2_residency.apply(model, torch.device("cpu"), L2Settings(32.0)) == []
    assert l2_residency.apply(model, torch.device("cuda"), L2Settings(0.0)) == []
    assert l2_residency.policy(model.weight) == l2_residency.SETTINGS.stream


@pytest.mark.parametrize("gated", [False, True])
def test_eviction_policy_changes_no_bit(gated):
    pytest.importorskip("triton")
    from rollout.layers import triton_gemv
    from tests.helpers import DEV, require_runnable_triton
    require_runnable_triton(triton_gemv._gemv_fma_kernel)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    x = torch.randn(1, 96, generator=gen).to(DEV, dtype)
    w = torch.randn(80, 96, generator=gen).to(DEV, dtype)
    cfg = triton_gemv.Config(8, 32, preload=2, lookahead=True)
    run = ((lambda: triton_gemv.skinny_gate_up_silu(x, w, 40, config=cfg)) if gated else
           (lambda: triton_gemv.skinny_linear(x, w, config=cfg)))
    plain = run()
    for hint in ("evict_last", "evict_first"):
        w.l2_policy = hint
        assert torch.equal(run(), plain), hint
