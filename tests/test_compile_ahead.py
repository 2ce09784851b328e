"""Compiling the graphs' Triton kernels ahead, in threads (rollout/triton_compile_ahead.py).

CPU: the hook's bookkeeping against a stand-in kernel (the forwards' launches skipped, later
launches of a queued variant finding a no-op in its cache, removed before any compile; one
compile per specialization: in the calling thread while each is a cache load, in the pool from
the first real compile on; other threads' launches let through; a failed compile left to the
first launch) and the config's validation. GPU: a cold start-up in a fresh process (empty Triton
cache) compiles its kernels ahead, none while capturing any graph and none at its first
`generate` (the step's kernels outside the graphs too), and the engine decodes the tokens of an
engine whose kernels compiled one at a time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from rollout import triton_compile_ahead
from rollout.config import EngineConfig
from rollout.errors import ConfigError
from rollout.triton_compile_ahead import (MAX_WORKERS, NOT_LAUNCHED, AheadStats, _AheadCompiler,
                                          compile_ahead, default_workers)


class _StandInKernel:
    """What the hook sees of a JITFunction: its name and `preload`."""

    def __init__(self, name: str, fail: bool = False, compile_s: float = 0.0):
        self.module, self.name, self.fail, self.compile_s = "tests", name, fail, compile_s
        self.jit_function = self
        self.preloaded: list[tuple[str, str]] = []
        self.device_caches = {0: ({}, {}, None, None, None)}  # Triton's layout: cache first

    @property
    def cache(self) -> dict:
        return self.device_caches[0][0]

    def preload(self, spec: str) -> None:
        self.preloaded.append((spec, threading.current_thread().name))
        time.sleep(self.compile_s)  # 0: a load from Triton's disk cache
        if self.fail:
            raise RuntimeError("no such kernel")


def _launch(compiler: _AheadCompiler, kernel: _StandInKernel, spec: str):
    """A launch as Triton's JITFunction.run makes it: the hook only on a cache miss."""
    if spec in kernel.cache:
        return kernel.cache[spec].run()
    return compiler.hook(key=spec, repr="r", fn=kernel,
                         compile={"specialization_data": spec, "device": 0},
                         is_manual_warmup=False, already_compiled=False)


def test_hook_skips_launches_and_compiles_each_specialization_once():
    compiler = _AheadCompiler(2, torch.device("cpu"))
    norm, gemv = _StandInKernel("norm"), _StandInKernel("gemv")
    for layer in range(3):  # three layers launching the same variants: a miss at the first
        answer = None if layer else True  # (skipped), the stand-in's no-op launch after
        assert _launch(compiler, norm, '{"BLOCK": 1}') is answer
        assert _launch(compiler, gemv, '{"M": 1}') is answer
        assert _launch(compiler, gemv, '{"M": 16}') is answer
    assert norm.cache['{"BLOCK": 1}'] is NOT_LAUNCHED and len(gemv.cache) == 2
    compiler.remove_stand_ins()
    assert norm.cache == {} and gemv.cache == {}  # no stand-in may outlive the forwards
    assert compiler.compile_all() == (3, 0)
    assert sorted(s for s, _ in norm.preloaded) == ['{"BLOCK": 1}']
    assert sorted(s for s, _ in gemv.preloaded) == sorted(['{"M": 1}', '{"M": 16}'])
    # loads from the disk cache (fast): all in the calling thread, no pool
    assert {t for k in (norm, gemv) for _, t in k.preloaded} == {threading.current_thread().name}


def test_the_queue_goes_to_threads_after_the_first_real_compile(monkeypatch):
    monkeypatch.setattr(triton_compile_ahead, "CACHE_LOAD_S", 0.01)
    compiler = _AheadCompiler(2, torch.device("cpu"))
    kernels = [_StandInKernel(f"k{i}", compile_s=0.02) for i in range(4)]
    for k in kernels:
        _launch(compiler, k, "{}")
    compiler.remove_stand_ins()
    assert compiler.compile_all() == (4, 0)
    threads = [k.preloaded[0][1] for k in kernels]
    assert threads[0] == threading.current_thread().name  # it took longer than a cache load
    assert all(t.startswith("triton-compile") for t in threads[1:])


def test_hook_lets_other_threads_launches_through():
    compiler = _AheadCompiler(1, torch.device("cpu"))
    kernel, answers = _StandInKernel("k"), []
    worker = threading.Thread(target=lambda: answers.append(_launch(compiler, kernel, "{}")))
    worker.start()
    worker.join()
    assert answers == [None]  # another thread's launch compiles and launches as usual
    assert compiler.compile_all() == (0, 0) and kernel.preloaded == []


def test_a_failed_compile_is_counted_and_left_to_the_first_launch(caplog):
    compiler = _AheadCompiler(2, torch.device("cpu"))
    good, bad = _StandInKernel("good"), _StandInKernel("bad", fail=True)
    _launch(compiler, good, "{}")
    _launch(compiler, bad, "{}")
    with caplog.at_level("WARNING"):
        assert compiler.compile_all() == (1, 1)
    assert "tests.bad" in caplog.text and "first launch" in caplog.text


def test_compile_ahead_is_off_without_compiled_kernels_or_threads():
    ran = []
    forward = lambda: ran.append(1)  # noqa: E731
    assert compile_ahead([forward], workers=1, device=torch.device("cpu")) == AheadStats()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        assert compile_ahead([forward], workers=4, device=torch.device("cpu")) == AheadStats()
    assert ran == []  # nothing to compile: the forwards are not run at all
    assert 1 <= default_workers() <= MAX_WORKERS


@pytest.mark.parametrize("bad", [-1, True, 2.0, "4"])
def test_compile_workers_is_validated(bad):
    with pytest.raises(ConfigError, match="compile_workers"):
        EngineConfig(compile_workers=bad)


_COLD_START = textwrap.dedent("""
    import json, sys
    from benchmarks.startup_time import compile_total, watch_compiles
    from rollout.engine import Engine
    from rollout.config import EngineConfig
    from rollout.sampling_params import SamplingParams

    compiles = watch_compiles()
    kw = dict(model_path=sys.argv[1], device="cuda", dtype="bfloat16", max_running_requests=8,
              cuda_graph_batch_sizes=(1, 2, 8), cuda_graph_prefill_tokens=(16, 64))
    ahead = Engine(EngineConfig(**kw, compile_workers=4))
    counts = {phase: sum(c.values()) for phase, c in compiles.items()}
    counts["compiled_ahead"] = ahead.runner.graph_runner.ahead.compiled
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    at_start = compile_total(compiles)
    # one request: its prefill and decode graphs and the step's kernels, all compiled ahead
    one = [o.token_ids for o in ahead.generate(prompts[:1], sp)]
    counts["first_generate"] = compile_total(compiles) - at_start
    ahead.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0.7, seed=1))
    counts["sampled_generate"] = compile_total(compiles) - at_start - counts["first_generate"]  # T != 1
    before = compile_total(compiles)
    # several requests: an eager prefill of 3 requests and 28 tokens, rows no graph reaches
    tokens = [o.token_ids for o in ahead.generate(prompts, sp)]
    counts["batch_generate"] = compile_total(compiles) - before
    ahead.shutdown()
    serial = Engine(EngineConfig(**kw, compile_workers=0))
    print(json.dumps({"counts": counts, "tokens": tokens, "one": one,
                      "serial": [o.token_ids for o in serial.generate(prompts, sp)],
                      "serial_one": [o.token_ids for o in serial.generate(prompts[:1], sp)]}))
""")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cold_start_compiles_ahead_and_capture_compiles_nothing(tiny_dirs, tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _COLD_START, tiny_dirs["Qwen2ForCausalLM"]],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    counts = out["counts"]
    # a cold cache: the first variant compiled in the calling thread, the rest in the pool
    assert counts.get("ahead", 0) > 0 and counts["compiled_ahead"] >= counts["ahead"], counts
    assert counts.get("capture", 0) == 0, counts  # every graph's kernels were compiled ahead
    # and the kernels a step launches outside the graphs (sampler, graph inputs, slot writes)
    assert counts["first_generate"] == 0 and counts["sampled_generate"] == 0, counts
    # and the eager multi-request prefill's (eager_prefill_ahead's stand-ins)
    assert counts["batch_generate"] == 0, counts
    assert out["tokens"] == out["serial"] and out["one"] == out["serial_one"]


def test_graph_runner_compiles_ahead_once_before_its_first_capture(tiny_dirs, monkeypatch):
    """The graph runner's own `_capture_graphs` on CPU, CUDA's pieces stood in: compile_ahead
    gets one runnable forward per decode graph (batch size x launch class) and per prefill
    graph before the first capture, the KV pool is zeroed after it, and a recapture (as
    resume_memory makes) does not compile ahead again: every variant is in memory by then."""
    from types import SimpleNamespace

    from rollout import cuda_graph_runner, eager_prefill_ahead, prefill_graphs
    from rollout.cuda_graph_runner import CudaGraphRunner
    from tests.helpers import DEV, RunnerDriver

    calls = []

    def compile_ahead_stand_in(forwards, workers, device):
        forwards = list(forwards)
        for forward in forwards:
            forward()
        calls.append(len(forwards))
        return AheadStats(compiled=len(forwards), workers=workers)

    def capture_stand_in(forward, pool):
        return SimpleNamespace(replay=forward), forward()

    monkeypatch.setattr(cuda_graph_runner, "compile_ahead", compile_ahead_stand_in)
    monkeypatch.setattr(cuda_graph_runner, "capture_graph", capture_stand_in)
    monkeypatch.setattr(prefill_graphs, "capture_graph", capture_stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    driver = RunnerDriver(tiny_dirs["Qwen2ForCausalLM"], device=DEV.type, attention_backend="triton",
                          cuda_graph=False, cuda_graph_batch_sizes=(1, 2, 4),
                          cuda_graph_prefill_tokens=(16, 32), compile_workers=3)
    cleared = []
    monkeypatch.setattr(driver.runner, "clear_kv_cache", lambda: cleared.append(len(calls)))
    runner = CudaGraphRunner(driver.runner)
    keys = runner.graph_keys()
    assert len(keys) == 5  # (1, 0), (1, 1), (2, 0), (2, 1), (4, 0): two classes up to 16 on CPU
    # the prefill graphs: 16 tokens by 1 and 16 requests, 32 by 1, 16 and 32 (the default sizes)
    prefills = len(runner.prefill.keys)
    assert prefills == 5
    # + the step's kernels outside the graphs: the sampler at one row (max_bs < 64) for float32
    # logits, T = 1 and not; the graph-input kernel with and without pending ids; the slot write
    step = 2 + 2 + 1
    # + the eager multi-request prefills, one a row class (this engine's budget holds them all)
    eager = len(eager_prefill_ahead.STAND_IN_TOKENS)
    assert len(eager_prefill_ahead.stand_in_forwards(driver.runner)) == eager
    assert calls == [len(keys) + prefills + step + eager] and cleared == [1]
    assert runner.ahead == AheadStats(compiled=len(keys) + prefills + step + eager, workers=3)
    assert torch.equal(runner.inputs.table, runner.inputs.pad)  # the stand-ins left them idle
    assert sorted(runner.graphs) == sorted(k for k, _ in keys)
    runner.release()
    runner.recapture()
    assert calls == [len(keys) + prefills + step + eager] and cleared == [1]
    assert len(runner.graphs) == len(keys)


def test_eager_prefill_stand_ins_reach_every_row_class_and_leave_no_trace(tiny_dirs):
    """The compile-ahead's stand-in prefills (`eager_prefill_ahead`): one EXTEND batch in each row
    class of the skinny GEMMs' configs and one past them (cuBLAS), over as many requests as the
    engine holds (the LM head's rows), their KV slots the pool's 1..n; and what they write (KV,
    req_to_token rows) changes nothing a real batch computes after them: a ragged prefill and
    two decode steps give a fresh runner's logits, bit for bit."""
    from rollout import eager_prefill_ahead
    from rollout.layers import gemv_launch
    from tests.helpers import DEV, RunnerDriver

    kw = dict(device=DEV.type, attention_backend="triton", cuda_graph=False, max_running_requests=16)
    driver, fresh = (RunnerDriver(tiny_dirs["Qwen2ForCausalLM"], **kw) for _ in range(2))
    mr, seen = driver.runner, []
    eager = mr.forward_eager

    def recorded(fb):
        logits = eager(fb)
        seen.append((fb.num_tokens, fb.batch_size, fb.extend_seq_lens_cpu,
                     fb.out_cache_loc.tolist(), tuple(logits.shape)))
        return logits
    mr.forward_eager = recorded
    forwards = eager_prefill_ahead.stand_in_forwards(mr)
    assert len(forwards) == len(eager_prefill_ahead.STAND_IN_TOKENS)  # the budget holds them all
    with torch.inference_mode():
        for forward in forwards:
            forward()
    del mr.forward_eager
    vocab = mr.model_config.vocab_size
    assert len(seen) == len(forwards)  # one eager forward each
    for (tokens, batch, lens, slots, shape), n in zip(seen, eager_prefill_ahead.STAND_IN_TOKENS):
        assert tokens == n and batch == min(n, 16) and sum(lens) == n and max(lens) - min(lens) <= 1
        assert sorted(slots) == list(range(1, n + 1)) and shape == (batch, vocab)
    edges = [2, 4, 8, 16, 32, 64, 128, gemv_launch.BATCH_MAX_M]  # the configs' row classes
    for low, high in zip([1] + edges, edges + [None]):
        assert any(low < n and (high is None or n <= high) for n, *_ in seen), (low, high)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(1, 12))]
    for d in (driver, fresh):
        d.logits = [d.prefill(prompts), d.decode([7, 8, 9]), d.decode([1, 2, 3])]
    for a, b in zip(driver.logits, fresh.logits):
        assert torch.equal(a, b)
    # an engine of one request and 64 positions: only the stand-ins whose prompt fits
    short = RunnerDriver(tiny_dirs["Qwen2ForCausalLM"], **dict(kw, max_running_requests=1,
                                                               max_context_len=64))
    kept = [f.args[1] for f in eager_prefill_ahead.stand_in_forwards(short.runner)]
    assert kept == [n for n in eager_prefill_ahead.STAND_IN_TOKENS if n <= 64]
