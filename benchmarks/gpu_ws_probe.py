"""Does the TMA kernel's warp-specialized K loop run on this GPU, with and without PDL? One
fused gate/up + SiLU call at 128 rows (Qwen2-1.5B), in a child process with a time limit (a
deadlocked kernel never returns): its error against the table's path and both times alone
(`triton.testing.do_bench`, median, µs; the weight fits in L2 here, so only for comparison).

  python benchmarks/gpu_ws_probe.py --out $OUT/ws_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, torch, triton
from rollout.layers.triton_gemv import Config, skinny_gate_up_silu
g = torch.Generator("cuda").manual_seed(0)
x = torch.randn(128, 1536, device="cuda", generator=g).bfloat16()
w = (torch.randn(17920, 1536, device="cuda", generator=g) * 0.03).bfloat16()
ws = Config(64, 64, 1, 4, True, 3, 64, tma=True, swap_ab=True, warp_specialize=True)
ref = skinny_gate_up_silu(x, w, 8960)
out = skinny_gate_up_silu(x, w, 8960, config=ws)
torch.cuda.synchronize()
err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
t_ws = triton.testing.do_bench(lambda: skinny_gate_up_silu(x, w, 8960, config=ws), return_mode="median")
t_table = triton.testing.do_bench(lambda: skinny_gate_up_silu(x, w, 8960), return_mode="median")
print(json.dumps({"rel_err": err, "ws_us": t_ws * 1e3, "table_us": t_table * 1e3,
                  "nan_out": int(out.isnan().sum()), "nan_ref": int(ref.isnan().sum()),
                  "inf_ref": int(ref.isinf().sum()), "numel": out.numel()}))
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--timeout-s", type=float, default=60)
    args = p.parse_args()
    result = {}
    for pdl in ("0", "1"):
        env = dict(os.environ, ROLLOUT_PDL=pdl)
        try:
            proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                                  text=True, timeout=args.timeout_s)
            result[f"pdl_{pdl}"] = (json.loads(proc.stdout.strip().splitlines()[-1])
                                    if proc.returncode == 0 else {"error": proc.stderr[-1500:]})
        except subprocess.TimeoutExpired:
            result[f"pdl_{pdl}"] = {"error": f"no return in {args.timeout_s} s (hang)"}
        print(f"PDL {pdl}: {result[f'pdl_{pdl}']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
