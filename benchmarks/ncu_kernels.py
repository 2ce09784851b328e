"""A decode layer's main kernels alone, for Nsight Compute's hardware counters (batch 128 by
default, `--rows 1` for one request): the fused gate/up + SiLU, qkv, o and down through
triton_gemv's table, down through cuBLAS (the engine's choice at 128 rows) and, at decode
batches, through the TMA kernel split along K, and the decode attention over a scattered paged
pool with the table's config and others (Qwen2-1.5B shapes, bf16). Each is run twice
to compile and warm up, then once between cudaProfilerStart/Stop, so that
`ncu --profile-from-start off` profiles one call of each with little device memory to save and
restore between its passes (under ncu, each kernel of an engine's decode graph took minutes:
ncu saves and restores the engine's GB of weights and KV pool around every pass).

  ncu --profile-from-start off --set detailed python benchmarks/ncu_kernels.py
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.gpu_attention import HEAD_DIM, HEADS, KV_HEADS, make_case
from rollout.attention.triton_kernels.decode import (DecodeConfig, decode_attention,
                                                      decode_buffers, decode_launch_config)
from rollout.layers import triton_gemv
from rollout.layers.triton_gemv import Config, skinny_gate_up_silu, skinny_linear

HIDDEN, INTER, QKV = 1536, 8960, 2048
DOWN_TMA = Config(64, 128, 5, 4, True, 4, 128, tma=True, swap_ab=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--attn-configs", nargs="*", default=["1,256,8,2", "1,256,4,2"],
                   help="decode attention configs to profile besides the table's")
    args = p.parse_args()
    dev, dt, m = "cuda", torch.bfloat16, args.rows
    g = torch.Generator(dev).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.02).to(dt)

    x, x_inter = rand(m, HIDDEN), rand(m, INTER)
    w_gate_up, w_down, w_qkv, w_o = rand(2 * INTER, HIDDEN), rand(HIDDEN, INTER), \
        rand(QKV, HIDDEN), rand(HIDDEN, HIDDEN)
    case = make_case(m, torch.Generator().manual_seed(0))
    bufs = decode_buffers(m, HEADS, HEAD_DIM, 8, dev)
    attn_out = torch.empty_like(case["q"])

    def attention(cfg):
        return decode_attention(case["q"], case["ks"][0], case["vs"][0], case["req_to_token"],
                                case["rows"], case["lens"], HEAD_DIM ** -0.5, config=cfg,
                                buffers=bufs, out=attn_out)

    calls = {
        "gate_up_table": lambda: skinny_gate_up_silu(x, w_gate_up, INTER),
        "qkv_table": lambda: skinny_linear(x, w_qkv),
        "o_table": lambda: skinny_linear(x, w_o),
        "down_cublas": lambda: F.linear(x_inter, w_down),
        "down_table": lambda: skinny_linear(x_inter, w_down),
        "attention_table": lambda: attention(decode_launch_config(m, kv_heads=KV_HEADS)),
    }
    if m > 16:  # the candidate for decode batches (one row runs the FMA kernels)
        calls["down_tma_split5_swapped"] = lambda: skinny_linear(x_inter, w_down, config=DOWN_TMA)
    for spec in args.attn_configs if m > 16 else []:
        cfg = DecodeConfig(*map(int, spec.split(",")))
        calls[f"attention_{spec}"] = lambda cfg=cfg: attention(cfg)
    print("gate/up table config:", triton_gemv._config(m, 2 * INTER, HIDDEN, True))
    for name, fn in calls.items():
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()
        print("profiled", name)


if __name__ == "__main__":
    main()
