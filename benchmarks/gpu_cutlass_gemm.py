"""The 128-row decode GEMMs as CUTLASS 3.x Hopper kernels (TMA, warp-specialized, thread-block
clusters sharing x through TMA multicast) next to cuBLAS and the engine's Triton path, alone on
one GPU: does a cluster that reads x once per cluster instead of once per weight tile close the
gap between the batch-128 GEMMs (gate/up 22 µs, down 12) and their weights' bandwidth floor?

The kernels are one C-ABI shared library (benchmarks/cutlass_probe/gemm_sm90.cu, one object a
config) built with nvcc against CUTLASS's headers (the flashinfer-python 0.6.0 wheel bundles
CUTLASS 4.2), so it loads with ctypes into any torch build:

  pip download --no-deps flashinfer-python==0.6.0 -d /tmp/fi    # CUTLASS's headers, in its wheel
  unzip -q /tmp/fi/*.whl 'flashinfer/data/cutlass/include/*' 'flashinfer/data/cutlass/tools/util/*' -d /tmp/fi
  python benchmarks/gpu_cutlass_gemm.py --build .cutlass_build \
      --cutlass-include /tmp/fi/flashinfer/data/cutlass/include     # any machine with nvcc 12.x+
  python benchmarks/gpu_cutlass_gemm.py --lib .cutlass_build/libgemm_probe.so --out $OUT/cutlass.json

(`gpu_suite.sh cutlass33` runs the second with `.cutlass_build` carried, and builds again on the
device from `.cutlass_build/cutlass/include` if the library does not load there.)

Timed as benchmarks/gpu_gemv.py (a CUDA graph of back-to-back calls rotating weight copies
larger than L2); every output checked against cuBLAS (relative error).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import traceback
from concurrent.futures import ThreadPoolExecutor

# name: (tile M = weight rows, tile N = batch rows, tile K, cluster M, cluster N, schedule
# 0 cooperative / 1 ping-pong / 2 basic, stream-K scheduler)
CONFIGS = {
    "t128x128x64_c1_coop": (128, 128, 64, 1, 1, 0, 0),
    "t128x128x64_c2_coop": (128, 128, 64, 2, 1, 0, 0),
    "t128x128x64_c4_coop": (128, 128, 64, 4, 1, 0, 0),
    "t128x128x128_c2_coop": (128, 128, 128, 2, 1, 0, 0),
    "t256x128x64_c2_coop": (256, 128, 64, 2, 1, 0, 0),
    "t64x128x64_c1_pp": (64, 128, 64, 1, 1, 1, 0),
    "t64x128x64_c2_pp": (64, 128, 64, 2, 1, 1, 0),
    "t64x128x64_c4_pp": (64, 128, 64, 4, 1, 1, 0),
    "t64x128x128_c2_pp": (64, 128, 128, 2, 1, 1, 0),
    "t128x128x64_c2_ws": (128, 128, 64, 2, 1, 2, 0),
    "t128x128x64_c1_coop_sk": (128, 128, 64, 1, 1, 0, 1),
    "t128x128x64_c2_coop_sk": (128, 128, 64, 2, 1, 0, 1),
    "t128x128x128_c2_coop_sk": (128, 128, 128, 2, 1, 0, 1),
    "t128x64x64_c2_coop_sk": (128, 64, 64, 2, 1, 0, 1),
}
# (mode, splits) tried with a stream-K config: 0 heuristic, 2 split-K, 3 stream-K
STREAMK_MODES = [(0, 1), (3, 1), (2, 2), (2, 4), (2, 5), (2, 7)]
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cutlass_probe", "gemm_sm90.cu")


def build(out_dir: str, include: str, jobs: int) -> str:
    """Compile every config (sm_90a) and link them into out_dir/libgemm_probe.so."""
    os.makedirs(out_dir, exist_ok=True)
    util = os.path.join(os.path.dirname(include), "tools", "util", "include")

    def compile_one(item):
        name, (tm, tn, tk, cm, cn, sched, sk) = item
        obj = os.path.join(out_dir, f"{name}.o")
        cmd = ["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "--expt-relaxed-constexpr",
               "-Xcompiler", "-fPIC", "-DNDEBUG", f"-I{include}", f"-I{util}", f"-DCFG={name}",
               f"-DTM={tm}", f"-DTN={tn}", f"-DTK={tk}", f"-DCM={cm}", f"-DCN={cn}",
               f"-DSCHED={sched}", f"-DSTREAMK={sk}", "-c", SRC, "-o", obj]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return name, obj, r.returncode, r.stderr[-2000:]

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(compile_one, CONFIGS.items()))
    objs = []
    for name, obj, rc, err in results:
        print(f"{name}: {'ok' if rc == 0 else 'FAILED'}", flush=True)
        if rc:
            print(err)
        else:
            objs.append(obj)
    lib = os.path.join(out_dir, "libgemm_probe.so")
    subprocess.run(["nvcc", "-shared", "-arch=sm_90a", "-cudart", "static", "-o", lib, *objs],
                   check=True)
    with open(os.path.join(out_dir, "configs.json"), "w") as f:
        json.dump([os.path.basename(o)[:-2] for o in objs], f)
    return lib


class Probe:
    """The library's configs as callables on torch tensors (the current stream)."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        with open(os.path.join(os.path.dirname(path), "configs.json")) as f:
            self.names = json.load(f)
        for n in self.names:
            getattr(self.lib, f"workspace_{n}").restype = ctypes.c_longlong
            getattr(self.lib, f"workspace_{n}").argtypes = [ctypes.c_int] * 5
            getattr(self.lib, f"gemm_{n}").argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5 \
                + [ctypes.c_void_p] * 2

    def call(self, name: str, mode: int, splits: int, x, weights, out):
        """fn(i): out = x @ weights[i]^T by config `name`, or None if it cannot run the shape."""
        import torch
        rows, k = weights[0].shape
        batch = x.shape[0]
        need = getattr(self.lib, f"workspace_{name}")(rows, batch, k, mode, splits)
        if need < 0:
            return None
        ws = torch.zeros(max(need, 16), dtype=torch.uint8, device="cuda")
        gemm = getattr(self.lib, f"gemm_{name}")

        def fn(i):
            stream = torch.cuda.current_stream().cuda_stream
            rc = gemm(weights[i].data_ptr(), x.data_ptr(), out.data_ptr(), rows, batch, k, mode,
                      splits, ws.data_ptr(), stream)
            if rc:
                raise RuntimeError(f"{name} mode {mode} splits {splits}: error {rc}")
            return out
        fn.workspace = ws
        return fn


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one fn() launches (torch.profiler): which cuBLAS kernel, tile and cluster
    shape a call takes."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def run_case(probe: Probe, name: str, M: int) -> dict:
    import torch
    import torch.nn.functional as F
    from benchmarks.gpu_gemv import SHAPES, rel_err, time_per_call, weight_copies
    from rollout.layers import triton_gemv as g, triton_ops
    N, K, _, gated = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = weight_copies(N, K, gen)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x, ws[0])
    row = {"name": name, "M": M, "N": N, "K": K, "weight_bytes": N * K * 2,
           "cublas_us": time_per_call(lambda i: F.linear(x, ws[i]), len(ws)) * 1e6,
           "cublas_w_xT_us": time_per_call(lambda i: torch.mm(ws[i], x.t()), len(ws)) * 1e6}
    row["cublas_kernels"] = kernel_names(lambda: F.linear(x, ws[0]))
    row["cublas_w_xT_kernels"] = kernel_names(lambda: torch.mm(ws[0], x.t()))
    if gated:
        row["cublas_silu_us"] = time_per_call(
            lambda i: triton_ops.silu_and_mul(F.linear(x, ws[i])), len(ws)) * 1e6
        if g.supports(x, ws[0], True):
            row["table_us"] = time_per_call(
                lambda i: g.skinny_gate_up_silu(x, ws[i], N // 2), len(ws)) * 1e6
    elif g.supports(x, ws[0], False):
        row["table_us"] = time_per_call(lambda i: g.skinny_linear(x, ws[i], None), len(ws)) * 1e6
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    tried = []
    for cfg in probe.names:
        modes = STREAMK_MODES if cfg.endswith("_sk") else [(0, 1)]
        for mode, splits in modes:
            entry = {"config": cfg, "mode": mode, "splits": splits}
            try:
                fn = probe.call(cfg, mode, splits, x, ws, out)
                if fn is None:
                    entry["error"] = "cannot implement"
                else:
                    a = fn(0).clone()
                    b = fn(0).clone()
                    torch.cuda.synchronize()
                    entry.update(rel_err=rel_err(a, ref), same_bits=bool(torch.equal(a, b)),
                                 us=time_per_call(fn, len(ws)) * 1e6)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            tried.append(entry)
            print(f"  {name} M={M} {cfg} mode {mode} splits {splits}: "
                  + (f"{entry['us']:.2f} µs err {entry['rel_err']:.1e}" if "us" in entry
                     else entry["error"]), flush=True)
    row["cutlass"] = tried
    ok = [t for t in tried if "us" in t and t["rel_err"] < 1e-2]
    if ok:
        row["best"] = min(ok, key=lambda t: t["us"])
    ws.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", help="compile the configs into this directory")
    p.add_argument("--cutlass-include", help="CUTLASS's include directory (for --build)")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--lib", help="the built libgemm_probe.so (to measure)")
    p.add_argument("--out")
    p.add_argument("--shapes", nargs="*", default=["gate_up", "down", "qkv", "o"])
    p.add_argument("--rows", nargs="*", type=int, default=[128, 64])
    args = p.parse_args()
    if args.build:
        print(build(args.build, args.cutlass_include, args.jobs))
        return
    from benchmarks.gpu_gemv import start_sweep
    probe = Probe(args.lib)
    result, _ = start_sweep()
    for M in args.rows:
        for name in args.shapes:
            try:
                row = run_case(probe, name, M)
            except Exception:
                result["errors"].append(f"{name} M={M}: {traceback.format_exc()}")
                continue
            result["cases"].append(row)
            best = row.get("best", {})
            print(f"{name} M={M}: cuBLAS {row['cublas_us']:.2f} (W xT {row['cublas_w_xT_us']:.2f}"
                  f"{', +SiLU %.2f' % row['cublas_silu_us'] if 'cublas_silu_us' in row else ''})"
                  f" table {row.get('table_us', float('nan')):.2f} | CUTLASS best "
                  f"{best.get('us', float('nan')):.2f} {best.get('config')} mode "
                  f"{best.get('mode')} splits {best.get('splits')}; cuBLAS kernels "
                  f"{row['cublas_kernels']} / {row['cublas_w_xT_kernels']}", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
