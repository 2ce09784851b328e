"""Nsight Compute's CSV pages (`ncu --import R --csv --page details` and `--page raw`) reduced to
what says why a kernel is slow: per kernel its duration, DRAM / L2 / SM throughput against peak,
occupancy (theoretical, achieved, waves), registers and shared memory, the share of elapsed
cycles its SMs were active (below 1: SMs idle at the end, unequal work), and where its warps
stalled (PC-sampling shares, in %). Runs anywhere (no GPU, no ncu): the `ncu-kernels` stage of
benchmarks/gpu_suite.sh writes the CSVs on the device machine.

  python benchmarks/ncu_summary.py --details d.csv --raw r.csv --label "batch 128" --out s.json
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

DETAILS = {  # our key: (section prefix, metric name) of the details page
    "duration_us": ("GPU Speed Of Light Throughput", "Duration"),
    "dram_pct": ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    "l2_pct": ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    "sm_pct": ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    "elapsed_cycles": ("GPU Speed Of Light Throughput", "Elapsed Cycles"),
    "sm_active_cycles": ("GPU Speed Of Light Throughput", "SM Active Cycles"),
    "memory_TBps": ("Memory Workload Analysis", "Memory Throughput"),
    "l2_hit_pct": ("Memory Workload Analysis", "L2 Hit Rate"),
    "registers": ("Launch Statistics", "Registers Per Thread"),
    "dynamic_smem_KB": ("Launch Statistics", "Dynamic Shared Memory Per Block"),
    "waves_per_sm": ("Launch Statistics", "Waves Per SM"),
    "theoretical_occupancy_pct": ("Occupancy", "Theoretical Occupancy"),
    "achieved_occupancy_pct": ("Occupancy", "Achieved Occupancy"),
}
STALL = "smsp__pcsamp_warps_issue_stalled_"


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def scaled(value: float, unit: str) -> float:
    """Memory throughput in TB/s and shared memory in KB, whatever unit ncu chose."""
    return value * {"Gbyte/s": 1e-3, "Mbyte/s": 1e-6, "Kbyte/s": 1e-9, "byte/block": 1e-3,
                    "Mbyte/block": 1e3}.get(unit, 1.0)


def read_details(path: Path) -> dict[str, dict]:
    kernels: dict[str, dict] = {}
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows)
        col = {h: i for i, h in enumerate(header)}
        wanted = {v: k for k, v in DETAILS.items()}
        for row in rows:
            if len(row) <= col["Metric Value"]:
                continue
            kid = row[col["ID"]]
            k = kernels.setdefault(kid, {"kernel": row[col["Kernel Name"]][:80],
                                         "grid": row[col["Grid Size"]],
                                         "block": row[col["Block Size"]]})
            key = wanted.get((row[col["Section Name"]], row[col["Metric Name"]]))
            value = number(row[col["Metric Value"]])
            if key and value is not None:
                k[key] = round(scaled(value, row[col["Metric Unit"]]), 3)
    for k in kernels.values():
        if k.get("elapsed_cycles") and k.get("sm_active_cycles"):
            k["sm_active_share"] = round(k["sm_active_cycles"] / k["elapsed_cycles"], 3)
    return kernels


def read_stalls(path: Path) -> dict[str, dict]:
    """PC-sampling stall shares per kernel (raw page: a header row, a units row, a row a kernel)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[0], rows[2:]
    cols = [i for i, h in enumerate(header) if h.startswith(STALL) and not h.endswith("not_issued")]
    out = {}
    for row in data:
        counts = {header[i][len(STALL):]: number(row[i]) or 0.0 for i in cols}
        total = sum(counts.values()) or 1.0
        out[row[header.index("ID")]] = {r: round(100 * c / total, 1)
                                        for r, c in sorted(counts.items(), key=lambda x: -x[1])
                                        if 100 * c / total >= 2.0}
    return out


def summarize(details: Path, raw: Path | None = None) -> list[dict]:
    """One dict a profiled kernel, in profiling order, stall shares added from the raw page."""
    kernels = read_details(details)
    if raw is not None:
        for kid, stalls in read_stalls(raw).items():
            if kid in kernels:
                kernels[kid]["stalls_pct"] = stalls
    return list(kernels.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--details", required=True)
    p.add_argument("--raw", default=None)
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    kernels = summarize(Path(args.details), Path(args.raw) if args.raw else None)
    Path(args.out).write_text(json.dumps({"label": args.label, "kernels": kernels}, indent=1))
    print(f"{'kernel':34} {'grid':>12} {'µs':>6} {'DRAM%':>6} {'L2%':>5} {'occ%':>5} "
          f"{'waves':>5} {'SMact':>5}  top stalls")
    for k in kernels:
        top = ", ".join(f"{r} {v:.0f}" for r, v in list(k.get("stalls_pct", {}).items())[:3])
        print(f"{k['kernel'][:34]:34} {k['grid']:>12} {k.get('duration_us', 0):6.2f} "
              f"{k.get('dram_pct', 0):6.1f} {k.get('l2_pct', 0):5.1f} "
              f"{k.get('achieved_occupancy_pct', 0):5.1f} {k.get('waves_per_sm', 0):5.2f} "
              f"{k.get('sm_active_share', 0):5.2f}  {top}")


if __name__ == "__main__":
    main()
