"""Smoke spec for `rollout bench weight-sync`: it runs end to end on a tiny shape and its JSON
has every field for every transport (not a timing assertion)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

FIELDS = {"transport", "shape", "tp_size", "bucket_mb", "gbytes", "latency_s", "p50_s", "p90_s",
          "gb_per_s", "phases_s", "floor_s", "floor_what", "ratio_to_floor", "error"}


def test_bench_command_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "actors.bench_cli", "bench", "weight-sync", "--shapes", "tiny", "--iters", "2",
           "--bucket-mb", "1", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "weight_sync.json").read_text())
    cases = result["cases"]
    assert {c["transport"] for c in cases} == {"disk", "nccl", "tensor", "ipc"}
    for c in cases:
        assert FIELDS <= set(c), FIELDS - set(c)
        assert c["error"] is None, c["error"]
        assert len(c["latency_s"]) == 2 and c["p50_s"] > 0 and c["floor_s"] > 0 and c["gbytes"] > 0
        assert {"pack", "transfer_and_load", "pause", "load", "resume"} <= set(c["phases_s"])
    assert (out / "weight_sync.png").stat().st_size > 1000
    assert "weight sync" in proc.stdout
