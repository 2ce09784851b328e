"""Triton kernels compiled in parallel threads before the CUDA graphs are captured.

Why: on a machine whose Triton cache is cold, the graphs' capture compiled their kernel
variants one at a time, each at its first launch: ~20 s of a ~24 s engine start-up on an H200
host, with its other CPU cores idle. Triton's compiler spends its time outside the GIL (the
MLIR passes in C++, ptxas in a subprocess), so threads compile side by side (two threads on a
2-core machine: four decode-attention variants for sm_90 in 2.2 s instead of 4.1).

How: `compile_ahead(forwards, workers, device)` runs each forward once with Triton's
`jit_cache_hook` set. A launch whose kernel variant is not in memory yet is then not launched:
its specialization (the JSON that `JITFunction.preload` takes) is queued, once per (kernel,
specialization). Torch and cuBLAS ops in those forwards run on whatever the skipped kernels left
in their outputs; nothing of it is read on the host (a forward that is captured has no host
sync) and the capture runs every forward again for real. Then the queue is compiled: in the
calling thread while each variant loads from Triton's disk cache, in a pool of `workers` threads
from the first real compile on. On return every variant sits in its kernel's in-memory cache,
so the capture compiles nothing.

A variant that fails to compile ahead is left to its first launch, which compiles it as
before (and raises there if it cannot be compiled at all): compiling ahead only saves time.
Off where kernels are not compiled (TRITON_INTERPRET=1, CPU) or with workers <= 1."""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

logger = logging.getLogger(__name__)

MAX_WORKERS = 32
# longer than loading a variant from Triton's disk cache (10-50 ms), shorter than compiling one
# (0.3-2 s for sm_90): the queue goes to the threads after the first variant that takes longer
CACHE_LOAD_S = 0.2


def default_workers() -> int:
    """The CPU cores this process may run on, at most MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


class _NotLaunched:
    """Stands in a kernel's in-memory cache for a queued variant while the forwards run: its
    next launches (the other layers') find it and launch nothing, where each miss would build
    the hook's arguments again (on an H200 host a warm start-up took 9.4 s without them, 6.0 s
    with them; 4.5 and 3.6 s without compiling ahead)."""

    function = packed_metadata = None

    def launch_metadata(self, *args) -> None:
        return None

    def run(self, *args) -> None:
        return None


NOT_LAUNCHED = _NotLaunched()


class _AheadCompiler:
    """Collects the specializations the forwards launch, then compiles them."""

    def __init__(self, workers: int, device: torch.device):
        self.workers, self.device = workers, device
        self.owner = threading.get_ident()  # the forwards' thread: other threads' launches pass
        self.pending: dict[tuple[str, str], Callable[[str], object]] = {}
        self.stand_ins: list[tuple[dict, str]] = []  # (a kernel's in-memory cache, key)

    def hook(self, *, key, fn, compile, **_) -> bool | None:
        """Triton's jit_cache_hook: True skips the launch (its compile is queued)."""
        if threading.get_ident() != self.owner:
            return None  # another thread of the process (e.g. another engine's): as usual
        self.pending.setdefault((f"{fn.module}.{fn.name}", compile["specialization_data"]),
                                fn.jit_function.preload)
        cache = _kernel_cache(fn.jit_function, compile.get("device"))
        if cache is not None and key not in cache:
            cache[key] = NOT_LAUNCHED
            self.stand_ins.append((cache, key))
        return True

    def remove_stand_ins(self) -> None:
        """Before any compile: a stand-in left in a cache would skip every later launch."""
        for cache, key in self.stand_ins:
            if cache.get(key) is NOT_LAUNCHED:
                del cache[key]
        self.stand_ins.clear()

    def compile_all(self) -> tuple[int, int]:
        """Compiles every queued specialization; (compiled, failed). In this thread while each
        comes from Triton's disk cache (a load is mostly Python: 16 threads loaded a warm
        cache's 59 variants in 2.9 s, one thread in 0.6), the rest `workers` at a time from the
        first that takes longer than a load (a real compile). Only after the forwards: threads
        loading beside them slowed them too."""
        queue, results = list(self.pending.items()), {}
        while queue:
            key, preload = queue.pop(0)
            start = time.perf_counter()
            results[key] = _outcome(preload, key[1])
            if time.perf_counter() - start > CACHE_LOAD_S:
                results.update(self._in_threads(queue))
                break
        failed = 0
        for (name, _), error in results.items():
            if error is not None:  # the first launch compiles it (and raises)
                failed += 1
                logger.warning("compiling %s ahead failed (%s: %s); its first launch compiles it",
                               name, type(error).__name__, error)
        return len(results) - failed, failed

    def _in_threads(self, queue: list) -> dict:
        # a worker compiles for its current device, which is a thread's own
        init = (torch.cuda.set_device, (self.device,)) if self.device.type == "cuda" else (None, ())
        with ThreadPoolExecutor(self.workers, thread_name_prefix="triton-compile",
                                initializer=init[0], initargs=init[1]) as pool:
            futures = {key: pool.submit(_outcome, preload, key[1]) for key, preload in queue}
        return {key: f.result() for key, f in futures.items()}


def _outcome(preload: Callable[[str], object], spec: str) -> Exception | None:
    try:
        preload(spec)
    except Exception as e:  # noqa: BLE001 - reported by compile_all
        return e
    return None


@dataclass(frozen=True)
class AheadStats:
    """What one `compile_ahead` did: variants compiled (or loaded from Triton's disk cache)
    and failed, seconds in the forwards and in the compiles."""

    compiled: int = 0
    failed: int = 0
    forwards_s: float = 0.0
    compile_s: float = 0.0
    workers: int = 0


def compile_ahead(forwards: Iterable[Callable[[], object]], workers: int,
                  device: torch.device) -> AheadStats:
    """Compiles the Triton kernel variants that `forwards` launch, in `workers` threads, without
    launching them (see the module docstring). With workers <= 1 or kernels that are not
    compiled, does nothing (all-zero stats)."""
    from triton import knobs  # lazily: CPU paths never import the compiler

    if workers <= 1 or not _compiles_kernels():
        return AheadStats()
    compiler = _AheadCompiler(workers, device)
    start = time.perf_counter()
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, compiler.hook
    try:
        for forward in forwards:
            forward()
    finally:
        knobs.runtime.jit_cache_hook = previous
        compiler.remove_stand_ins()
    compiling = time.perf_counter()
    compiled, failed = compiler.compile_all()
    stats = AheadStats(compiled, failed, round(compiling - start, 3),
                       round(time.perf_counter() - compiling, 3), workers)
    logger.info("Triton kernels compiled ahead: %s", stats)
    return stats


def _kernel_cache(jit_function, device) -> dict | None:
    """A JITFunction's in-memory cache of compiled variants on `device` (key -> kernel), where
    this Triton keeps it as 3.6 and 3.9 do (the first item of `device_caches[device]`); None
    elsewhere, and the forwards then pay for every miss."""
    entry = getattr(jit_function, "device_caches", {}).get(device)
    cache = entry[0] if isinstance(entry, tuple) and entry else None
    return cache if isinstance(cache, dict) else None


def _compiles_kernels() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()


__all__ = ["compile_ahead", "default_workers", "AheadStats", "MAX_WORKERS"]
