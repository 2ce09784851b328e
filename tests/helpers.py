"""Shared test helpers: the HF oracle, a direct ModelRunner driver, and the device / Triton
guards of the kernel specs."""
from __future__ import annotations

import functools

import pytest
import torch

from rollout.batch_builder import build_batch
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import SINGLE, TPGroup
from rollout.forward_batch import ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.model_runner import ModelRunner

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def gpu(test):
    """A spec that needs a CUDA GPU (marked `gpu`; `bash benchmarks/gpu_suite.sh smoke` runs them)."""
    return pytest.mark.gpu(pytest.mark.skipif(DEV.type != "cuda", reason="needs a CUDA GPU")(test))


class H200CompileTarget:
    """Just enough of a Triton driver for a jit kernel's `warmup` to compile for sm_90 on a
    machine without a GPU (nothing launches): `triton.runtime.driver.set_active(...)`. For the
    Gluon kernels' CPU specs and benchmarks/compile_sm90.py."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 64)

    def get_device_interface(self):
        return torch.cuda


def require_runnable_triton(kernel) -> None:
    """Skip the calling test module when its Triton kernels cannot run here: on CPU they must
    have been decorated under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction
    if DEV.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set",
                    allow_module_level=True)


@torch.inference_mode()
def eager_graph_capture(self) -> None:
    """Stands in for `CudaGraphRunner._capture_graphs` without CUDA (monkeypatch it in): each "graph",
    decode or prefill, re-runs the forward eagerly on the static buffers, so replay reads
    exactly what a captured graph would read."""
    from types import SimpleNamespace
    for key, max_seq_len in self.graph_keys():
        fb = self._static_batch(key[0], [max_seq_len] * key[0])
        self.backend.init_forward_metadata_capture(fb)
        # what a captured graph keeps of the backend's metadata: the capture's launch
        meta = getattr(self.backend, "meta", None)
        self.outputs[key] = self._forward(fb)

        def replay(fb=fb, key=key, meta=meta):
            if meta is None:
                self.outputs[key].copy_(self._forward(fb))
                return
            replayed, self.backend.meta = self.backend.meta, meta
            self.outputs[key].copy_(self._forward(fb))
            self.backend.meta = replayed
        self.graphs[key] = SimpleNamespace(replay=replay)
    prefill = self.prefill
    for key in prefill.keys if prefill is not None else ():
        fb = prefill.static_batch(*key)
        prefill.forward(fb)
        prefill.graphs[key] = SimpleNamespace(replay=functools.partial(prefill.forward, fb))


def hf_model(path: str, dtype=torch.float32):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


@torch.no_grad()
def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


class RunnerDriver:
    """Drives a ModelRunner the way the scheduler does, without sampling: prefill a ragged
    batch, then decode with caller-chosen tokens."""

    def __init__(self, path: str, tp: TPGroup = SINGLE, **cfg):
        cfg.setdefault("kv_cache_tokens", 4096)
        self.config = EngineConfig(model_path=path, **cfg)
        self.runner = ModelRunner(ModelConfig.from_pretrained(path), self.config, tp)
        self.alloc = KVAllocator(self.config.max_running_requests + 1, self.runner.num_token_slots,
                                 self.runner.max_context_len)
        self.rows: list[int] = []
        self.lens: list[int] = []

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        self.rows = [self.alloc.alloc_row() for _ in prompts]
        fb = build_batch(ForwardMode.EXTEND, self.rows, prompts, [0] * len(prompts), self.alloc,
                         self.runner.device)
        self.lens = [len(p) for p in prompts]
        return self.forward(fb)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        fb = build_batch(ForwardMode.DECODE, self.rows, [[t] for t in tokens], self.lens,
                         self.alloc, self.runner.device)
        self.lens = [n + 1 for n in self.lens]
        return self.forward(fb)

    def forward(self, fb) -> torch.Tensor:
        """The one place a batch reaches the runner (a TP leader's driver announces it first).
        Like the engine, it hands CPU threads back before returning to the test."""
        try:
            return self.runner.forward(fb)
        finally:
            self.runner.release_cpu_threads()


def sync_flags(engine, prompts, params) -> int:
    """Host synchronisations torch's sync debug mode flags during `engine.generate(prompts,
    params)`, after a warm-up call of the same (allocator, graphs)."""
    import warnings
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def kv_pool_whole(scheduler) -> bool:
    """Nothing resident and every KV slot with exactly one owner: the allocator's free lists or
    the prefix cache's tree (whose nodes no request holds), each slot 1..capacity once; every
    request row free. What an engine between calls must be (a leak or a double free fails)."""
    import numpy as np
    alloc, cache = scheduler.alloc, scheduler.cache
    parts = [alloc._free_slots, *alloc._released]
    if cache is not None:
        nodes = cache._nodes()
        if any(x.holders for x in nodes):
            return False
        parts += [x.slots for x in nodes]
    owned = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    return (not scheduler.has_work and not scheduler.finished_pending
            and alloc.num_free_rows == alloc.table.shape[0]
            and np.array_equal(owned, np.arange(1, alloc.capacity + 1)))
