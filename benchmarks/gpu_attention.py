"""Decode attention on one GPU: rollout/attention/triton_kernels/decode.py's launch configs
(KV splits, keys per block, warps, pipeline stages) swept at the decode benchmark's shape
(Qwen2-1.5B: 12 query heads, 2 KV heads, head_dim 128, bf16; `--heads 16 8`: Qwen3-1.7B's)
for batches 1, 32 and 128 with the contexts of a 128 + 128 token run (129-256 keys; `--keys LO
HI` for others, e.g. long contexts), over a token-granular paged pool whose slots are scattered
as the allocator leaves them; `--configs` times a given list instead of the sweep.

Each time is a CUDA graph of one call per layer (28), each layer's KV in its own buffers (more
than the L2 holds at batch 128), replayed and divided. Every config's output is checked against
torch (softmax attention in fp32 on the gathered keys): relative error (norm of the difference
over the norm) <= 1e-2. Prints per batch the default (the backend's current choice) and the
best configs.

  python benchmarks/gpu_attention.py --out $OUT/attention.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback

import torch

from benchmarks.cuda_timing import replay_seconds

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 12, 2, 128, 28
BATCHES = [1, 32, 128]


PROMPT = 128


def slot_table(lens: list[int], layout: str, gen: torch.Generator) -> torch.Tensor:
    """[batch, max(256, longest)] request -> slot table (slot 0: the dummy, never used).
    `random`: every slot anywhere; `engine`: as the engine's allocator leaves a 128 + 128 run
    (each prompt in one piece, then one slot per request per step, so a request's decode tokens
    lie `batch` slots apart); `contiguous`: each request's tokens in one piece."""
    batch, total = len(lens), sum(lens)
    table = torch.zeros(batch, max(256, max(lens)), dtype=torch.int32)
    if layout == "random":
        slots, start = torch.randperm(total, generator=gen) + 1, 0
        for b, n in enumerate(lens):
            table[b, :n] = slots[start:start + n].to(torch.int32)
            start += n
    elif layout == "contiguous":
        start = 1
        for b, n in enumerate(lens):
            table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
    elif layout == "engine":
        if max(lens) > 256:
            raise ValueError("the engine layout is a 128 + 128 run: at most 256 keys")
        prompt = [min(n, PROMPT) for n in lens]
        for b, n in enumerate(prompt):
            table[b, :n] = torch.arange(1 + b * PROMPT, 1 + b * PROMPT + n, dtype=torch.int32)
        nxt = 1 + batch * PROMPT
        for pos in range(PROMPT, 256):  # a decode step: one slot for each request still running
            for b, n in enumerate(lens):
                if pos < n:
                    table[b, pos] = nxt
                    nxt += 1
    else:
        raise ValueError(layout)
    return table


def make_case(batch: int, gen: torch.Generator, layout: str = "random",
              keys: tuple[int, int] = (129, 256)) -> dict:
    lo, hi = keys
    lens = (torch.randint(lo, hi + 1, (batch,), generator=gen) if batch > 1
            else torch.tensor([(lo + hi) // 2]))
    req_to_token = slot_table(lens.tolist(), layout, gen)
    dev = "cuda"
    pool = (int(req_to_token.max()) + 1, KV_HEADS, HEAD_DIM)
    # drawn on the GPU: long contexts make GBs of keys
    kv_gen = torch.Generator(dev).manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    ks = [torch.randn(pool, generator=kv_gen, device=dev).to(torch.bfloat16) for _ in range(LAYERS)]
    vs = [torch.randn(pool, generator=kv_gen, device=dev).to(torch.bfloat16) for _ in range(LAYERS)]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
    return dict(lens=lens.to(dev), req_to_token=req_to_token.to(dev), ks=ks, vs=vs, q=q,
                rows=torch.arange(batch, device=dev), lens_cpu=lens.tolist())


def reference(case: dict, layer: int, scale: float) -> torch.Tensor:
    """On the host in float64 (the reference needs no GPU library)."""
    q = case["q"].cpu().double()
    ks, vs = case["ks"][layer].cpu().double(), case["vs"][layer].cpu().double()
    r2t = case["req_to_token"].cpu()
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for b, n in enumerate(case["lens_cpu"]):
        slots = r2t[b, :n].long()
        k = ks[slots].repeat_interleave(group, 1)  # [n, H, D]
        v = vs[slots].repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * scale, -1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    global HEADS, KV_HEADS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--layouts", nargs="+", default=["random"],
                   choices=["random", "engine", "contiguous"], help="where the slots lie")
    p.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    p.add_argument("--current-only", action="store_true", help="no sweep: the current config")
    p.add_argument("--keys", nargs=2, type=int, default=[129, 256], metavar=("LO", "HI"),
                   help="keys a request, drawn uniformly (default: a 128 + 128 run's contexts)")
    p.add_argument("--configs", nargs="*", default=None, metavar="S,N,W,ST",
                   help="instead of the sweep: these configs (splits,block_n,warps,stages)")
    p.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8],
                   help="the sweep's KV splits")
    p.add_argument("--heads", nargs=2, type=int, default=[HEADS, KV_HEADS], metavar=("Q", "KV"),
                   help="query and KV heads (default Qwen2-1.5B's; Qwen3-1.7B: 16 8)")
    args = p.parse_args()
    HEADS, KV_HEADS = args.heads
    from rollout.attention.triton_kernels.decode import (DecodeConfig, decode_attention,
                                                          decode_buffers, decode_launch_config)
    deadline = time.perf_counter() + args.budget_s
    scale = HEAD_DIM ** -0.5
    gen = torch.Generator().manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "heads": [HEADS, KV_HEADS], "rows": [],
              "errors": []}
    grid = [DecodeConfig(s, bn, w, st) for s, bn, w, st in
            itertools.product(args.splits, (16, 32, 64, 128), (2, 4, 8), (2, 3, 4))]
    grid += [c._replace(preload_kv=True) for c in grid if c.splits == 1]
    for batch, layout in itertools.product(args.batches, args.layouts):
        case = make_case(batch, gen, layout, tuple(args.keys))
        ref = reference(case, 0, scale)
        bufs = decode_buffers(batch, HEADS, HEAD_DIM, 8, "cuda")
        out = torch.empty_like(case["q"])
        current = decode_launch_config(batch, max_keys=max(case["lens_cpu"]),  # the engine's
                                       kv_heads=KV_HEADS)
        if args.configs is not None:
            grid = [DecodeConfig(*map(int, c.split(","))) for c in args.configs]
        configs = [current] + ([] if args.current_only else [c for c in grid if c != current])
        row = {"batch": batch, "layout": layout, "lens_mean": sum(case["lens_cpu"]) / batch,
               "tried": []}

        def run(cfg, layer):
            return decode_attention(case["q"], case["ks"][layer], case["vs"][layer],
                                    case["req_to_token"], case["rows"], case["lens"], scale,
                                    buffers=bufs, out=out, config=cfg)

        for j, cfg in enumerate(configs):
            if j > 0 and time.perf_counter() > deadline:
                row["cut_by_budget"] = True
                break
            entry = {"config": cfg._asdict(), "current": j == 0}
            try:
                entry["rel_err"] = rel_err(run(cfg, 0).cpu(), ref)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for layer in range(LAYERS):
                        run(cfg, layer)
                entry["us_per_call"] = replay_seconds(graph, 10) / LAYERS * 1e6
                del graph
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["tried"].append(entry)
        ok = [t for t in row["tried"] if "us_per_call" in t and t["rel_err"] <= 1e-2]
        bad = [t for t in row["tried"] if "rel_err" in t and t["rel_err"] > 1e-2]
        row["best"] = sorted(ok, key=lambda t: t["us_per_call"])[:8]
        row["wrong"] = len(bad)
        result["rows"].append(row)
        cur = row["tried"][0]
        print(f"batch {batch}, {layout} slots (mean {row['lens_mean']:.0f} keys): current {tuple(cur['config'].values())} "
              f"{cur.get('us_per_call', float('nan')):.2f} µs, err {cur.get('rel_err', float('nan')):.1e}; "
              f"{len(row['tried'])} tried, {row['wrong']} wrong")
        for t in row["best"]:
            print(f"   {t['us_per_call']:6.2f} µs  {tuple(t['config'].values())}  err {t['rel_err']:.1e}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
