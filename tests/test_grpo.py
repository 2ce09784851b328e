"""The GRPO example (examples/grpo.py): it learns, the trainer and the rollout agree on logprobs
(fp32), every step's samples come from the weights pushed the step before, on every transport;
and it runs as a Ray job submitted to a `ray start --head` cluster."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.ray_helpers import local_ray

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_example", REPO / "examples" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grpo():
    with local_ray(num_cpus=2):  # one session for every in-process run (the controller reuses it)
        yield load_example()


def check_versions_and_mismatch(records: list[dict]) -> None:
    steps = len(records)
    # Step k samples with the weights of the k-th push, every token of every sample.
    assert [r["weight_version"] for r in records] == list(range(steps))
    assert [r["min_token_version"] for r in records] == list(range(steps))
    assert [r["pushed_version"] for r in records] == list(range(1, steps + 1))
    # fp32: the engine and the HF trainer compute the same function (measured ~2e-6 at most).
    assert max(r["mismatch_max"] for r in records) <= 1e-4


@pytest.mark.ray
def test_grpo_learns_digits(grpo, tmp_path):
    # Run-to-run noise, measured over seeds 0-7 with these settings (20 steps, 8 prompts x 8
    # samples, 8 new tokens, lr 3e-3, 2 updates per step): mean reward of the first 4 steps
    # 0.017-0.031, of the last 4 steps 0.60-0.80; their difference 0.58-0.78 (mean 0.67,
    # sd 0.05). The margin 0.3 is more than 5 sd below the smallest difference seen.
    start = time.perf_counter()
    summary = grpo.main(["--steps", "20", "--seed", "1",
                         "--log", str(tmp_path / "grpo.csv"), "--plot", str(tmp_path / "grpo.png")])
    records = summary["records"]
    first = sum(r["reward"] for r in records[:4]) / 4
    last = sum(r["reward"] for r in records[-4:]) / 4
    assert last - first >= 0.3, [round(r["reward"], 3) for r in records]
    check_versions_and_mismatch(records)
    assert (tmp_path / "grpo.csv").read_text().splitlines()[0].startswith("step,reward,")
    assert (tmp_path / "grpo.png").stat().st_size > 0
    assert time.perf_counter() - start < 90


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["disk", "ipc", "nccl"])
def test_grpo_other_transports(grpo, transport, tmp_path):
    summary = grpo.main(["--steps", "3", "--transport", transport, "--log", str(tmp_path / "log.json")])
    check_versions_and_mismatch(summary["records"])
    logged = json.loads((tmp_path / "log.json").read_text())
    assert logged["args"]["transport"] == transport and len(logged["records"]) == 3


# ---- ray job submit ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, head: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until the dashboard answers at all (an auth error is an answer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start exited early"
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no answer from {url} after {timeout_s}s")


def processes_under(path: str) -> list[int]:
    """Pids whose command line names `path` (this cluster's temp dir: only its own processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and path in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def stop_head(head: subprocess.Popen, temp_dir: str) -> list[int]:
    """`ray start --block` stops every process it started when it gets SIGTERM. Unlike
    `ray stop`, this leaves other Ray clusters on the machine alone. Returns the pids that
    were still alive after 20 s (then killed by pid)."""
    head.terminate()
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()
    deadline = time.monotonic() + 20
    while processes_under(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = processes_under(temp_dir)
    for pid in left:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return left


@pytest.mark.ray
def test_grpo_as_ray_job():
    # A short temp dir: Ray's unix sockets live under it and their paths must stay < 108 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")
    port, dash, client, agent = (free_port() for _ in range(4))
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    # Ray 2.60 turns token authentication on for `ray start --head` (token in ~/.ray/auth_token)
    # and maps --node-ip-address=127.0.0.1 to the host's address for the GCS; the dashboard (the
    # jobs API) is bound to loopback.
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         "--num-cpus=4", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=open(Path(temp_dir) / "head.log", "w"), stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{dash}"
    job_env = dict(env, RAY_AUTH_MODE="token")
    submission_id = f"grpo-{os.getpid()}-{int(time.time())}"
    try:
        wait_for_http(f"{address}/api/version", head)
        submit = subprocess.run(
            ["ray", "job", "submit", "--address", address, "--working-dir", ".",
             "--runtime-env-json", json.dumps({"excludes": [".git", ".whl", "__pycache__", "*.egg-info"]}),
             "--submission-id", submission_id, "--",
             "python", "examples/grpo.py", "--steps", "2"],
            cwd=REPO, env=job_env, capture_output=True, text=True, timeout=180)
        out = submit.stdout + submit.stderr
        assert submit.returncode == 0, out[-4000:]
        assert "step   1  reward" in out and "outputs v1" in out, out[-4000:]
        status = subprocess.run(["ray", "job", "status", "--address", address, submission_id],
                                env=job_env, capture_output=True, text=True, timeout=60)
        # The CLI's words for JobStatus.SUCCEEDED (other states print "Status for job ...: X").
        assert f"Job '{submission_id}' succeeded" in status.stdout, status.stdout + status.stderr
    finally:
        left = stop_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"processes of the cluster still alive after ray start got SIGTERM: {left}"
