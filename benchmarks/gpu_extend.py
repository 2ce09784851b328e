"""Extend (prefill) attention on one GPU: rollout/attention/triton_kernels/extend.py's launch
configs (new tokens a program, keys a step, warps, pipeline stages) swept at the decode
benchmark's prefill (Qwen2-1.5B heads: 12 query, 2 KV, head_dim 128, bf16; fresh prompts of
128 tokens): a chunk of 64 requests (the batch-128 prefill runs two) and one request.

Each time is a CUDA graph of one call per layer (28, each layer's q and KV its own), replayed
and divided. Every config's output is checked against torch's causal softmax attention in
fp32: relative error (norm of the difference over the norm) <= 1e-2.

  python benchmarks/gpu_extend.py --out $OUT/extend.json
"""
from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import replay_seconds

HEADS, KV_HEADS, HEAD_DIM, LAYERS, PROMPT = 12, 2, 128, 28, 128
CONFIGS = [(64, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 3),
           (128, 64, 8, 2), (128, 64, 4, 2), (64, 32, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2),
           (128, 128, 8, 2), (64, 128, 8, 2), (128, 32, 8, 3), (64, 64, 8, 4), (32, 64, 2, 3)]
# the query heads of a KV head packed into one program (ExtendConfig.packed; 6 heads padded to 8
# rows a token): block_m tokens a head, so 8 · block_m rows a program; `--packed` runs them next
# to UNPACKED, the best of CONFIGS (the default before packing)
UNPACKED = (64, 32, 4, 3)
PACKED = [(16, 32, 4, 2, True), (16, 32, 8, 2, True), (16, 32, 4, 3, True), (16, 64, 8, 2, True),
          (8, 32, 4, 2, True), (8, 64, 4, 3, True), (32, 32, 8, 2, True), (16, 16, 4, 3, True)]


def make_case(batch: int, gen: torch.Generator) -> dict:
    tokens = batch * PROMPT
    dev, bf16 = "cuda", torch.bfloat16
    qs = [torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dev, bf16) for _ in range(LAYERS)]
    ks = [torch.randn(tokens + 1, KV_HEADS, HEAD_DIM, generator=gen).to(dev, bf16)
          for _ in range(LAYERS)]
    vs = [torch.randn(tokens + 1, KV_HEADS, HEAD_DIM, generator=gen).to(dev, bf16)
          for _ in range(LAYERS)]
    # each prompt in one piece of slots, as the allocator lays them (slot 0: the dummy)
    req_to_token = (torch.arange(tokens, dtype=torch.int32) + 1).view(batch, PROMPT).to(dev)
    lens = torch.full((batch,), PROMPT, dtype=torch.int64, device=dev)
    return dict(batch=batch, qs=qs, ks=ks, vs=vs, req_to_token=req_to_token,
                rows=torch.arange(batch, device=dev), start=torch.arange(batch, device=dev) * PROMPT,
                ext=lens, prefix=torch.zeros_like(lens))


def reference(case: dict) -> torch.Tensor:
    q = case["qs"][0].float().view(case["batch"], PROMPT, HEADS, HEAD_DIM).transpose(1, 2)
    kv = [t[0][1:].float().view(case["batch"], PROMPT, KV_HEADS, HEAD_DIM).transpose(1, 2)
          .repeat_interleave(HEADS // KV_HEADS, 1) for t in (case["ks"], case["vs"])]
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True)
    return out.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)


def main() -> None:
    from rollout.attention.triton_kernels.extend import ExtendConfig, extend_attention, extend_config
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--batches", nargs="+", type=int, default=[64, 1])
    p.add_argument("--packed", action="store_true",
                   help="the packed configs, next to the best unpacked one")
    args = p.parse_args()
    configs = [UNPACKED] + PACKED if args.packed else CONFIGS
    gen = torch.Generator().manual_seed(0)
    default = extend_config(HEAD_DIM, torch.bfloat16, HEADS // KV_HEADS)
    result = {"device": torch.cuda.get_device_name(), "default": list(default),
              "cases": []}
    for batch in args.batches:
        case = make_case(batch, gen)
        ref = reference(case)
        outs = [torch.empty_like(q) for q in case["qs"]]

        def call(cfg, layer):
            return extend_attention(case["qs"][layer], case["ks"][layer], case["vs"][layer],
                                    case["req_to_token"], case["rows"], case["start"], case["ext"],
                                    case["prefix"], PROMPT, HEAD_DIM ** -0.5, out=outs[layer],
                                    config=cfg)
        rows = []
        for c in configs:
            cfg, row = ExtendConfig(*c), {"config": c}
            try:
                first = call(cfg, 0).clone()
                row["rel_err"] = ((first.float() - ref).norm() / ref.norm()).item()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for layer in range(LAYERS):
                        call(cfg, layer)
                row["us_per_call"] = replay_seconds(graph, 20) * 1e6 / LAYERS
                row["ok"] = row["rel_err"] <= 1e-2
            except Exception as e:  # does not compile / fit
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc(limit=1)
            rows.append(row)
            print(f"batch {batch:3} {c}: " + (f"{row['us_per_call']:8.2f} µs  rel err {row['rel_err']:.1e}"
                                               if "us_per_call" in row else row["error"]), flush=True)
        result["cases"].append({"batch": batch, "tokens": batch * PROMPT, "configs": rows})
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
