"""Smoke spec for `rollout bench weight-sync`: it runs end to end on a tiny shape and its JSON
has every field for every transport (not a timing assertion)."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

FIELDS = {"transport", "shape", "tp_size", "bucket_mb", "bucket_bytes", "bucket_source", "gbytes", "latency_s", "p50_s", "p90_s",
          "gb_per_s", "phases_s", "floor_s", "floor_what", "ratio_to_floor", "fast_channel", "error"}


def test_bench_command_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "actors.bench_cli", "bench", "weight-sync", "--shapes", "tiny", "tiny-moe",
           "--iters", "2",
           "--bucket-mb", "1", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "weight_sync.json").read_text())
    cases = result["cases"]
    assert {c["transport"] for c in cases} == {"disk", "nccl", "tensor", "ipc"}
    assert {c["shape"] for c in cases} == {"tiny", "tiny-moe"}
    for c in cases:
        assert FIELDS <= set(c), FIELDS - set(c)
        assert c["error"] is None, c["error"]
        assert len(c["latency_s"]) == 2 and c["p50_s"] > 0 and c["floor_s"] > 0 and c["gbytes"] > 0
        assert {"pack", "transfer_and_load", "pause", "load", "resume", "first_push"} <= set(c["phases_s"])
        if c["transport"] != "disk":
            assert (c["bucket_bytes"], c["bucket_source"]) == (1 << 20, "given")
    ipc = next(c for c in cases if c["transport"] == "ipc" and c["shape"] == "tiny")
    assert "register" in ipc["phases_s"]
    assert ipc["fast_channel"] and ipc["phases_s"]["channel_roundtrip"] > 0  # TP=1: the push channel
    assert "ray_roundtrip" in ipc["phases_s"]
    assert not any(c["fast_channel"] for c in cases if c["transport"] != "ipc")
    assert (out / "weight_sync.png").stat().st_size > 1000
    assert "weight sync" in proc.stdout
