"""Where the norms-in-GEMVs path (rollout/layers/pending_norm.py) gains or loses at one row:
the two sub-chains of a decode layer it changes, side by side with the add + norm kernels, in a
CUDA graph under PDL (the engine's decode policy), Qwen2-1.5B shapes, bf16, weights rotating
over copies larger than L2 (read from HBM), as benchmarks/gpu_gemv.py times:

  mlp:  o → add + RMSNorm → gate/up + SiLU     against  o (adding into the residual) → gate/up
        (normalizing its input)
  attn: down (split, partials) → split add + RMSNorm → qkv + rotary + KV store   against
        down (unsplit, adding into the residual) → qkv + rotary (normalizing its input)

and each GEMV alone in both forms, over a few launch configs of the changed GEMVs.

  python benchmarks/gpu_norm_gemv.py --out $OUT/norm_gemv.json
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch

from benchmarks.gpu_gemv import time_per_call, weight_copies
from rollout import pdl_policy
from rollout.layers import triton_gemv as g
from rollout.layers import triton_ops
from rollout.layers import triton_qkv_rope as qr
from rollout.layers.pending_norm import PendingNorm

EPS = 1e-6
HEADS = qr.QKVHeads(12, 2, 128)
C = g.Config
GATE_UP = {  # the table's first
    "table": g._config(1, 17920, 1536, True),
    "4w": C(2, 512, 1, 4, False, 3, preload=2, lookahead=True),
    "pre3": C(2, 512, 1, 2, False, 3, preload=3),
    "pre1": C(2, 512, 1, 2, False, 3, preload=1),
    "1row": C(1, 512, 1, 2, False, 3, preload=2, lookahead=True),
    "pre3_4w": C(2, 512, 1, 4, False, 3, preload=3),
    "pre3_1row": C(1, 512, 1, 2, False, 3, preload=3),
    "pre3_4row_4w": C(4, 512, 1, 4, False, 3, preload=3),
}
DOWN_ADD = {
    "table_unsplit": g.add_to_config(1, 1536, 8960),
    "1row": C(1, 512, 1, 4, False, 3, preload=3, lookahead=True),
    "1row_1024": C(1, 1024, 1, 4, False, 3, preload=3, lookahead=True),
    "2row_1024_8w": C(2, 1024, 1, 8, False, 3, preload=3, lookahead=True),
    "1row_2w": C(1, 512, 1, 2, False, 3, preload=3, lookahead=True),
    "1row_256": C(1, 256, 1, 2, False, 3, preload=3, lookahead=True),
    "2row_2048_8w": C(2, 2048, 1, 8, False, 3, preload=3, lookahead=True),
    "1row_2048_8w": C(1, 2048, 1, 8, False, 3, preload=3, lookahead=True),
    "1row_1024_8w": C(1, 1024, 1, 8, False, 3, preload=3, lookahead=True),
    "2row_1024_16w": C(2, 1024, 1, 16, False, 3, preload=3, lookahead=True),
    "4row_1024_16w": C(4, 1024, 1, 16, False, 3, preload=3, lookahead=True),
    "2row_1024_8w_pre2": C(2, 1024, 1, 8, False, 3, preload=2, lookahead=True),
}


def _exact(on: bool) -> None:
    g.NORM_EXACT = on


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    w_o, w_gu = weight_copies(1536, 1536, gen), weight_copies(17920, 1536, gen)
    w_down, w_qkv = weight_copies(1536, 8960, gen), weight_copies(2048, 1536, gen)
    bias = torch.randn(2048, device=dev, dtype=dt) * 0.1
    nw = (1 + 0.1 * torch.randn(1536, device=dev)).to(dt)
    x_attn = torch.randn(1, 1536, device=dev, dtype=dt)
    act = torch.randn(1, 8960, device=dev, dtype=dt)
    res = torch.randn(1, 1536, device=dev, dtype=dt)
    cos = torch.randn(1, 1, 64, device=dev, dtype=dt)
    sin = torch.randn(1, 1, 64, device=dev, dtype=dt)
    loc = torch.tensor([3], device=dev)
    kb = torch.zeros(8, 2, 128, device=dev, dtype=dt)
    vb = torch.zeros(8, 2, 128, device=dev, dtype=dt)
    kv = triton_ops.KVStore(None, loc, kb, vb)
    qkv_cfg = qr.fused_config(x_attn, w_qkv[0], HEADS)

    def o(i, add):
        with pdl_policy.preloaders_early():
            return g.skinny_linear(x_attn, w_o[i % len(w_o)], add_to=res if add else None)

    def gate_up(i, x, cfg):
        return g.skinny_gate_up_silu(x, w_gu[i % len(w_gu)], 8960, config=cfg)

    def qkv(i, x):
        return qr.qkv_rope(x, w_qkv[i % len(w_qkv)], bias, cos, sin, HEADS, kv, qkv_cfg)

    def down(i, cfg=None, add=False):
        w = w_down[i % len(w_down)]
        if add:
            return g.skinny_linear(act, w, config=cfg, add_to=res)
        return g.skinny_linear(act, w, defer_split=True)

    cases = {
        "mlp/norm_kernel": lambda i: gate_up(
            i, triton_ops.fused_add_rms_norm(o(i, False), res, nw, EPS)[0], GATE_UP["table"]),
        "o/plain": lambda i: o(i, False),
        "o/add_to": lambda i: o(i, True),
        "gate_up/plain": lambda i: gate_up(i, x_attn, GATE_UP["table"]),
        "attn/norm_kernel": lambda i: qkv(
            i, triton_ops.split_add_rms_norm(down(i), res, nw, EPS)[0]),
        "down/split": lambda i: down(i),
        "qkv/plain": lambda i: qkv(i, x_attn),
        "qkv/pending": lambda i: qkv(i, PendingNorm(res, nw, EPS)),
    }
    for name, cfg in GATE_UP.items():
        for exact in (True, False):  # the norm kernel's roundings, or the fold (none)
            tag = name if exact else f"{name} fold"
            cases[f"mlp/pending {tag}"] = (
                lambda i, cfg=cfg, e=exact: (_exact(e), o(i, True),
                                             gate_up(i, PendingNorm(res, nw, EPS), cfg)))
            cases[f"gate_up/pending {tag}"] = (
                lambda i, cfg=cfg, e=exact: (_exact(e),
                                             gate_up(i, PendingNorm(res, nw, EPS), cfg)))
    cases["attn/pending fold 2row_1024_8w"] = lambda i: (
        _exact(False), down(i, DOWN_ADD["2row_1024_8w"], True),
        qkv(i, PendingNorm(res, nw, EPS)), _exact(True))
    for name, cfg in DOWN_ADD.items():
        cases[f"attn/pending {name}"] = (
            lambda i, cfg=cfg: (down(i, cfg, True), qkv(i, PendingNorm(res, nw, EPS))))
        cases[f"down/add_to {name}"] = lambda i, cfg=cfg: down(i, cfg, True)
    results = {}
    with pdl_policy.decode_forward():
        for name, fn in cases.items():
            try:
                us = time_per_call(fn, 60) * 1e6
                results[name] = round(us, 3)
            except Exception:  # noqa: BLE001 - record and go on
                results[name] = traceback.format_exc(limit=2)
            print(f"{name:32s} {results[name]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), us_per_call=results,
                       gate_up=dict((k, v._asdict()) for k, v in GATE_UP.items()),
                       down_add=dict((k, v._asdict()) for k, v in DOWN_ADD.items())), f, indent=1)


if __name__ == "__main__":
    main()
