"""Batch 1's decoder stack as ONE persistent CUDA kernel (benchmarks/megakernel/decode_b1.cu),
checked against a torch reference of the same step and timed against the weights' floor.

The engine's batch-1 decode graph is a chain of ~7 kernels a layer; under PDL it still loses
≈10 µs a layer to the kernel boundaries (the weight stream restarts at each, BENCHMARKS.md).
This kernel keeps one weight stream per SM running across every phase of every layer (TMA bulk
copies into a shared-memory ring, issued ahead by a producer warp) and orders the phases with
grid barriers instead of kernel boundaries.

  python benchmarks/gpu_megakernel.py --out $OUT/megakernel.json     # gpu_suite.sh mk34

The kernel is compiled on the device by NVRTC (the library torch's CUDA wheels ship;
`megakernel/cuda_module.py` loads and launches it through the driver API on torch's stream, so
CUDA graphs capture it); --cubin-dir takes prebuilt cubins instead (`nvcc -cubin
-arch=sm_90a -D...`, named as `build` names them). Configs: NSLOTS:EVICT_FIRST:MAX_INFLIGHT
[:MIN_SPLIT] (ring slots, L2 evict-first hint on the weight copies, copies in flight per SM,
fewest keys an attention split; the tagged-word variant is in commit ff09a90). --profile-* builds with -DPROFILE=1:
%globaltimer marks at every phase of every CTA and layer, the stream waits of consumers and
producer, and each grid barrier's arrival spread and last-arrival-to-first-departure time.

Checks (relative error against the torch reference, bf16 roundings as HF's): a 2-layer build
at contexts of 1 to 4,097 keys (the split plan's edges), the cache slot of the new token's k and
v, the 28-layer build at two contexts, and the kernel run twice giving the same bits. Timing: a
CUDA graph of (input copy, kernel) replayed back to back, weights of all 28 layers (2.6 GB,
far past L2) read every replay; the floor is their bytes at the copy bandwidth measured here as
the decode table measures it. Outcome (BENCHMARKS.md, thirty-fourth session): correct, slower
than the engine's kernel chain — not used by the engine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.megakernel import cuda_module  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megakernel")
SRC = os.path.join(HERE, "decode_b1.cu")
H, I, HEADS, KVH, D, EPS, THETA = 1536, 8960, 12, 2, 128, 1e-6, 1e6
NCW, NTHREADS, MAX_SPLITS, NMARK = 8, 288, 16, 24
PHASES = ["rms1", "qkv", "B1", "attention", "B2", "merge", "o", "B3", "rms2", "gate_up", "B4",
          "act_load", "down", "B5"]
QKV = (HEADS + 2 * KVH) * D
BF = torch.bfloat16
DEV = "cuda"


class Weights:
    """Random Qwen2-1.5B-shaped layers (std 0.02 GEMV weights, norms near 1), KV caches, rope."""

    def __init__(self, layers: int, slots: int, seed: int = 0):
        g = torch.Generator(device=DEV).manual_seed(seed)

        def rnd(*shape, std=0.02):
            return (torch.randn(*shape, generator=g, device=DEV) * std).to(BF)

        self.layers = []
        for _ in range(layers):
            self.layers.append(dict(
                ln1=(1 + rnd(H, std=0.1).float()).to(BF), w_qkv=rnd(QKV, H), b_qkv=rnd(QKV, std=0.1),
                w_o=rnd(H, H), ln2=(1 + rnd(H, std=0.1).float()).to(BF), w_gu=rnd(2 * I, H),
                w_down=rnd(H, I), k=rnd(slots, KVH, D, std=1.0), v=rnd(slots, KVH, D, std=1.0)))
        self.final_ln = (1 + rnd(H, std=0.1).float()).to(BF)
        from rollout.layers.rotary import RotaryEmbedding
        self.rope = RotaryEmbedding(D, 16384, THETA).to(DEV).half_table(BF).contiguous()
        self.slots = slots

    def ptr_table(self) -> torch.Tensor:
        rows = [[l[k].data_ptr() for k in ("ln1", "w_qkv", "b_qkv", "w_o", "ln2", "w_gu", "w_down",
                                          "k", "v")] for l in self.layers]
        return torch.tensor(rows, dtype=torch.int64, device=DEV)

    def weight_bytes(self) -> int:
        return sum(l[k].numel() * 2 for l in self.layers for k in ("w_qkv", "w_o", "w_gu", "w_down"))


def reference(w: Weights, h: torch.Tensor, pos: int, row: torch.Tensor, n_ctx: int, loc: int,
              exact: bool = False):
    """The step in torch: (h after the layers, final norm, new k/v per layer). HF's bf16
    roundings (after every GEMV, norm as w * bf16(h * rstd), rotary and attention in float32
    rounded once), or with `exact` every op in float32 and no rounding: the bar both bf16 paths
    are held to. The caches are not written."""
    dt = torch.float32 if exact else BF
    h = h.to(dt)
    cos, sin = w.rope[pos, 0].float(), w.rope[pos, 1].float()

    def norm(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return wt.to(dt) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(dt)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(dt)

    new_kv = []
    for L in w.layers:
        qkv = F.linear(norm(h, L["ln1"]), L["w_qkv"].to(dt), L["b_qkv"].to(dt))
        q = rotate(qkv[:HEADS * D].view(HEADS, D))
        k = rotate(qkv[HEADS * D:(HEADS + KVH) * D].view(KVH, D))
        v = qkv[(HEADS + KVH) * D:].view(KVH, D)
        new_kv.append((k, v))
        idx = row[:n_ctx].long()
        keys, vals = L["k"][idx].float(), L["v"][idx].float()  # [n, KVH, D]; the last is new
        keys[-1], vals[-1] = k.float(), v.float()
        kk = keys.repeat_interleave(HEADS // KVH, dim=1)  # [n, HEADS, D]
        vv = vals.repeat_interleave(HEADS // KVH, dim=1)
        s = torch.einsum("hd,nhd->hn", q.float(), kk) / math.sqrt(D)
        attn = torch.einsum("hn,nhd->hd", s.softmax(-1), vv).to(dt).reshape(HEADS * D)
        h = h + F.linear(attn, L["w_o"].to(dt))
        gu = F.linear(norm(h, L["ln2"]), L["w_gu"].to(dt))
        h = h + F.linear(F.silu(gu[:I]) * gu[I:], L["w_down"].to(dt))
    return h, norm(h, w.final_ln), new_kv


class MegaStep:
    """The kernel's buffers and its launch for one request."""

    def __init__(self, kernel: cuda_module.CudaKernel, w: Weights, max_context: int):
        self.k, self.w = kernel, w
        self.table = w.ptr_table()
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.qkv_buf = torch.zeros(QKV, dtype=BF, device=DEV)
        self.part = torch.zeros(HEADS * MAX_SPLITS * (D + 2), dtype=torch.float32, device=DEV)
        self.act = torch.zeros(I, dtype=BF, device=DEV)
        # barrier counters and flags (a 128-byte line each) and the launch epoch: zeroed once
        self.counters = torch.zeros(32 * 2 * 5 * len(w.layers) + 32, dtype=torch.int32, device=DEV)
        self.scalars = torch.zeros(4, dtype=torch.int64, device=DEV)  # position, seq_len, loc, req
        self.req_to_token = torch.zeros(2, max_context, dtype=torch.int32, device=DEV)
        self.out = torch.zeros(H, dtype=BF, device=DEV)
        self.prof = torch.zeros(self.sms, len(w.layers), NMARK, dtype=torch.int64, device=DEV)

    def set_request(self, pos: int, n_ctx: int, loc: int, row: torch.Tensor) -> None:
        self.scalars.copy_(torch.tensor([pos, n_ctx, loc, 1]))
        self.req_to_token[1, :n_ctx] = row[:n_ctx]

    def __call__(self, h: torch.Tensor) -> None:
        s = self.scalars
        self.k.launch(self.sms, NTHREADS, [
            self.table, h, self.out, self.w.final_ln, self.w.rope, s[0:1], s[1:2], s[2:3], s[3:4],
            self.req_to_token, self.req_to_token.shape[1], self.qkv_buf, self.part, self.act,
            self.counters, self.prof])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def case(w: Weights, step: MegaStep, n_ctx: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(w.slots - 1, generator=g)[:n_ctx] + 1
    row, loc, pos = perm.to(torch.int32).to(DEV), int(perm[n_ctx - 1]), n_ctx - 1
    h0 = (torch.randn(H, generator=g) * 0.5).to(BF).to(DEV)
    h_ref, out_ref, kv_ref = reference(w, h0, pos, row, n_ctx, loc)
    _, out_32, _ = reference(w, h0, pos, row, n_ctx, loc, exact=True)
    step.set_request(pos, n_ctx, loc, row)
    h1 = h0.clone()
    step(h1)
    out1 = step.out.clone()
    h2 = h0.clone()
    step(h2)
    torch.cuda.synchronize()
    kv_err = max(max(rel(L["k"][loc], k), rel(L["v"][loc], v)) for L, (k, v) in zip(w.layers, kv_ref))
    return dict(n_ctx=n_ctx, rel_h=rel(h1, h_ref), rel_out=rel(out1, out_ref), rel_new_kv=kv_err,
                rel_out_vs_fp32=rel(out1, out_32), torch_bf16_rel_out_vs_fp32=rel(out_ref, out_32),
                same_bits_twice=bool(torch.equal(h1, h2) and torch.equal(out1, step.out)),
                finite=bool(torch.isfinite(h1.float()).all()))


def time_graph(fn, replays: int = 50, rounds: int = 7) -> float:
    """Median µs of one fn() inside a CUDA graph of `replays` calls."""
    from benchmarks.cuda_timing import replay_seconds
    from rollout.graph_capture import capture_graph

    def calls() -> torch.Tensor:
        for _ in range(replays):
            fn()
        return torch.empty(0, device=DEV)

    graph, _ = capture_graph(calls, None)
    return statistics.median(replay_seconds(graph, 1) for _ in range(rounds)) * 1e6 / replays


def build(layers: int, nslots: int, evict_first: int, cubin_dir: str | None, **extra):
    defines = dict(LAYERS=layers, NSLOTS=nslots, EVICT_FIRST=evict_first, **extra)
    name = f"decode_b1_L{layers}_s{nslots}_e{evict_first}" + "".join(
        f"_{k}{v}" for k, v in extra.items()) + ".cubin"
    cubin, how = cuda_module.cubin_for(SRC, "decode_b1", defines,
                                       os.path.join(cubin_dir, name) if cubin_dir else None)
    probe = cuda_module.CudaKernel(cubin, "smem_bytes_probe")
    n = torch.zeros(1, dtype=torch.int32, device=DEV)
    probe.launch(1, 1, [n])
    kernel = cuda_module.CudaKernel(cubin, "decode_b1", int(n.item()))
    blocks = kernel.max_blocks_per_sm(NTHREADS)
    if blocks < 1:
        raise RuntimeError(f"{name}: does not fit on an SM")
    return kernel, dict(built_by=how, registers=kernel.attribute(4), local_bytes=kernel.attribute(3),
                        smem=int(n.item()), blocks_per_sm=blocks, **defines)


def profile(w: Weights, cubin_dir: str | None, inflight: int, n_ctx: int = 192) -> dict:
    """Per-phase cycles of a layer (PROFILE build), for a CTA with an attention item and one
    without, averaged over layers 2..27; the stream waits of the consumers and the producer."""
    kernel, info = build(28, 11, 1, cubin_dir, MAX_INFLIGHT=inflight, MIN_SPLIT=16, PROFILE=1)
    step = MegaStep(kernel, w, 8192)
    g = torch.Generator().manual_seed(n_ctx)
    perm = torch.randperm(w.slots - 1, generator=g)[:n_ctx] + 1
    step.set_request(n_ctx - 1, n_ctx, int(perm[-1]), perm.to(torch.int32).to(DEV))
    h0 = (torch.randn(H, generator=g) * 0.5).to(BF).to(DEV)
    for _ in range(3):
        h = h0.clone()
        step(h)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    h = h0.clone()
    a.record()
    step(h)
    b.record()
    b.synchronize()
    us = a.elapsed_time(b) * 1000
    p = step.prof.cpu()[:, 2:].double() / 1000  # globaltimer ns -> µs; layers 2..27
    marks = p[:, :, :15]
    out = dict(info=info, kernel_us=us, ctas={}, barriers={}, phases_over_ctas={})
    d = marks[:, :, 1:] - marks[:, :, :-1]  # [cta, layer, phase]
    for i, name in enumerate(PHASES):
        v = d[:, :, i].mean(1)  # per CTA, averaged over layers
        out["phases_over_ctas"][name] = dict(min=round(float(v.min()), 3),
                                             median=round(float(v.median()), 3),
                                             max=round(float(v.max()), 3))
    for name, (arrive, leave) in dict(B1=(2, 3), B2=(4, 5), B3=(7, 8), B4=(10, 11), B5=(13, 14)).items():
        a, l = marks[:, :, arrive], marks[:, :, leave]
        out["barriers"][name] = dict(
            arrival_spread_us=round(float((a.max(0).values - a.min(0).values).mean()), 3),
            last_arrival_to_first_leave_us=round(float((l.min(0).values - a.max(0).values).mean()), 3),
            slowest_arriver=int(torch.mode(a.argmax(0)).values))
    for cta in (0, 100):
        out["ctas"][cta] = dict(
            layer_us=round(float((marks[cta, :, 14] - marks[cta, :, 0]).mean()), 3),
            consumer_stream_wait_us=dict(zip(("qkv", "o", "gate_up", "down"),
                                             [round(float(v), 3) for v in p[cta, :, 15:19].mean(0)])),
            producer_empty_wait_us=round(float(p[cta, :, 19].mean()), 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cubin-dir", default=None)
    ap.add_argument("--configs", default="11:1:2:16,11:1:1:16,11:1:2:64,8:1:2:16",
                    help="NSLOTS:EVICT_FIRST:MAX_INFLIGHT[:MIN_SPLIT] list")
    ap.add_argument("--profile-inflight", type=int, default=2)
    ap.add_argument("--contexts", default="1,2,15,16,17,63,64,65,129,200,1000,1025,4097")
    args = ap.parse_args()
    res: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, checks=[],
                     timings=[])

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        w2 = Weights(2, 8192, seed=1)
        k2, info = build(2, 11, 1, args.cubin_dir)
        res["build_2_layers"] = info
        step = MegaStep(k2, w2, 8192)
        for n in [int(c) for c in args.contexts.split(",")]:
            r = case(w2, step, n, seed=n)
            res["checks"].append(dict(layers=2, **r))
            print("check", r, flush=True)
            save()
        del w2, step
    except Exception:
        res["error_2_layers"] = traceback.format_exc()
        print(res["error_2_layers"], flush=True)
        save()
    w = Weights(28, 8192, seed=2)
    from benchmarks.decode_throughput import copy_bandwidth  # the decode table's own measure
    res["copy_GBps"] = copy_bandwidth(DEV) / 1e9
    res["weight_bytes"] = w.weight_bytes()
    res["floor_us"] = w.weight_bytes() / (res["copy_GBps"] * 1e9) * 1e6
    lm = torch.randn(151936, H, device=DEV).to(BF)
    xrow = torch.randn(1, H, device=DEV).to(BF)
    res["lm_head_cublas_us"] = time_graph(lambda: F.linear(xrow, lm))
    del lm
    print("copy GB/s", res["copy_GBps"], "floor µs", res["floor_us"], "lm head µs",
          res["lm_head_cublas_us"], flush=True)
    save()
    for cfg in args.configs.split(","):
        nslots, evict, inflight, min_split = (int(x) for x in (cfg.split(":") + ["16"])[:4])
        try:
            k28, info = build(28, nslots, evict, args.cubin_dir, MAX_INFLIGHT=inflight,
                              MIN_SPLIT=min_split)
            step = MegaStep(k28, w, 8192)
            entry = dict(info)
            if cfg == args.configs.split(",")[0]:
                for n in (200, 1000):
                    r = case(w, step, n, seed=100 + n)
                    res["checks"].append(dict(layers=28, config=cfg, **r))
                    print("check", cfg, r, flush=True)
            for n in (192, 1024):
                g = torch.Generator().manual_seed(n)
                perm = torch.randperm(w.slots - 1, generator=g)[:n] + 1
                step.set_request(n - 1, n, int(perm[-1]), perm.to(torch.int32).to(DEV))
                h = (torch.randn(H, generator=g) * 0.5).to(BF).to(DEV)
                h0 = h.clone()

                def one():
                    h.copy_(h0)
                    step(h)

                entry[f"us_ctx{n}"] = time_graph(one)
            entry["us_reset_only"] = time_graph(lambda: h.copy_(h0))
            entry["us_per_layer_ctx192"] = (entry["us_ctx192"] - entry["us_reset_only"]) / 28
            entry["floor_fraction_ctx192"] = res["floor_us"] / (entry["us_ctx192"] - entry["us_reset_only"])
            res["timings"].append(entry)
            print("timing", entry, flush=True)
        except Exception:
            res.setdefault("errors", []).append(dict(config=cfg, error=traceback.format_exc()))
            print(cfg, traceback.format_exc(), flush=True)
        save()
    try:
        res["profile"] = profile(w, args.cubin_dir, args.profile_inflight)
        print("profile", json.dumps(res["profile"], indent=1), flush=True)
    except Exception:
        res["profile_error"] = traceback.format_exc()
        print(res["profile_error"], flush=True)
    save()


if __name__ == "__main__":
    main()
