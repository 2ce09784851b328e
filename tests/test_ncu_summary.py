"""benchmarks/ncu_summary.py reads Nsight Compute's CSV pages as ncu writes them: rows with or
without the rule columns, units ncu picks per value, a units row under the raw page's header."""
import csv

from benchmarks import ncu_summary

HEAD = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
        "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
        "Metric Value", "Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type",
        "Estimated Speedup"]


def details_row(kid, kernel, section, name, unit, value, rule=False):
    row = [kid, "1", "python3", "127.0.0.1", kernel, "1", "7", "(128, 1, 1)", "(280, 1, 1)", "0",
           "9.0", section, name, unit, value]
    return row + (["Occ", "OPT", "a rule's advice", "local", "20"] if rule else [])


def write(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)


def test_summary_of_details_and_raw_pages(tmp_path):
    sol, mem, launch = ("GPU Speed Of Light Throughput", "Memory Workload Analysis",
                        "Launch Statistics")
    write(tmp_path / "d.csv", [HEAD,
        details_row("0", "_gemm_tma_kernel", sol, "Duration", "us", "23.33"),
        details_row("0", "_gemm_tma_kernel", sol, "Elapsed Cycles", "cycle", "41,684"),
        details_row("0", "_gemm_tma_kernel", sol, "SM Active Cycles", "cycle", "32,123.64"),
        details_row("0", "_gemm_tma_kernel", mem, "Memory Throughput", "Gbyte/s", "808.48"),
        details_row("0", "_gemm_tma_kernel", launch, "Dynamic Shared Memory Per Block",
                    "byte/block", "73,784"),
        details_row("0", "_gemm_tma_kernel", "Occupancy", "", "", "", rule=True),
        details_row("1", "_rms_norm_kernel", mem, "Memory Throughput", "Tbyte/s", "2.49")])
    raw_head = ["ID", "Kernel Name", ncu_summary.STALL + "long_scoreboard",
                ncu_summary.STALL + "long_scoreboard_not_issued", ncu_summary.STALL + "wait",
                ncu_summary.STALL + "barrier"]
    write(tmp_path / "r.csv", [raw_head, ["", "", "", "", "", ""],
                              ["0", "_gemm_tma_kernel", "1,190", "999", "200", "10"],
                              ["1", "_rms_norm_kernel", "0", "0", "0", "0"]])
    gemm, norm = ncu_summary.summarize(tmp_path / "d.csv", tmp_path / "r.csv")
    assert gemm["kernel"] == "_gemm_tma_kernel" and gemm["grid"] == "(280, 1, 1)"
    assert gemm["duration_us"] == 23.33 and gemm["elapsed_cycles"] == 41684.0
    assert gemm["sm_active_share"] == round(32123.64 / 41684, 3)
    assert gemm["memory_TBps"] == 0.808 and norm["memory_TBps"] == 2.49  # one unit, TB/s
    assert gemm["dynamic_smem_KB"] == 73.784
    # shares of the issued-stall samples (the not-issued counters are left out), >= 2% only
    assert gemm["stalls_pct"] == {"long_scoreboard": 85.0, "wait": 14.3}
    assert norm["stalls_pct"] == {}  # no samples: nothing, not a division by zero
