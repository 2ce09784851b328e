"""CPU one-row GEMMs (batch-1 decode) through numpy's OpenBLAS, and the thread mode they need.

A batch-1 decode step of a small model is a chain of ~20 one-row GEMMs (GEMVs) between cheap
elementwise ops. oneDNN spends ~10 µs of fixed cost on each GEMV (a 256 × 256 one takes 14 µs
with its weights in cache, OpenBLAS's sgemv 2.6 µs), and torch's OpenMP team forks and joins for
each. OpenBLAS's worker threads instead wait for the next GEMV spinning, so the GEMVs run on
every core and the rest of the step on the calling thread: on the cpu-small benchmark shape a
batch-1 decode step takes ~0.78 ms instead of ~1.1 ms.

The two thread pools must never spin at the same time: with torch's OpenMP workers and
OpenBLAS's workers both on the same cores, every hand-off of one pool waits for the other's
threads to be descheduled (a step took 14× longer), and either pool's workers keep spinning
for milliseconds after their last call (OpenBLAS ~0.1 s; libgomp's 300k spins, which stalled a
decode step by 4 ms right after a prefill). So `OneRowBlas` owns the switch: `enter()` moves the
calling thread's torch work to one thread, ends its OpenMP team's workers
(`omp_pause_resource_all`) and gives OpenBLAS the thread count torch had; `leave()` stops
OpenBLAS's workers (`blas_thread_shutdown_`) and gives torch its threads back. Each pool's
workers restart on their next call (~35 µs). The model runner enters for one-row steps and
leaves before any other; the engine leaves whenever it hands control back to its caller. The
mode belongs to the thread that entered; other threads keep oneDNN meanwhile. Stopping
OpenBLAS's workers assumes no other thread runs a threaded numpy BLAS call at that moment.

Off (oneDNN for every CPU GEMM) unless numpy's BLAS is an OpenBLAS and torch's OpenMP runtime
can pause, both found among the loaded libraries; ROLLOUT_CPU_OPENBLAS=0 turns it off."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Callable, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

# numpy's wheels bundle OpenBLAS with a symbol prefix/suffix (scipy-openblas in numpy 2, a "64_"
# suffix before): the spellings tried for openblas_{set,get}_num_threads
_OPENBLAS_NAMES = [(pre, suf) for pre in ("scipy_openblas_", "openblas_") for suf in ("64_", "", "_64_")]
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t
_MAX_ARRAYS = 4096  # weight arrays kept (a model has a few per layer)


def _loaded_library(*name_parts: str) -> Optional[ctypes.CDLL]:
    """A shared library already mapped into this process whose file name contains one of
    `name_parts` (the one numpy or torch loaded, not another copy), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path).lower()
        if ".so" in name and any(part in name for part in name_parts):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


class _Threads:
    """The two runtimes' calls `OneRowBlas` needs."""

    def __init__(self, blas_set: Callable, blas_get: Callable, blas_stop: Callable, omp_pause: Callable):
        self._blas_set, self._blas_get = blas_set, blas_get
        self.stop_blas_workers, self._omp_pause = blas_stop, omp_pause

    @classmethod
    def find(cls) -> Optional["_Threads"]:
        blas, omp = _loaded_library("openblas"), _loaded_library("libgomp", "libiomp", "libomp")
        if blas is None or omp is None or not hasattr(blas, "blas_thread_shutdown_") \
                or not hasattr(omp, "omp_pause_resource_all"):
            return None
        for pre, suf in _OPENBLAS_NAMES:
            blas_set = getattr(blas, f"{pre}set_num_threads{suf}", None)
            blas_get = getattr(blas, f"{pre}get_num_threads{suf}", None)
            if blas_set is not None and blas_get is not None:
                blas_set.argtypes, blas_get.restype = [ctypes.c_int], ctypes.c_int
                omp.omp_pause_resource_all.argtypes = [ctypes.c_int]
                return cls(blas_set, blas_get, blas.blas_thread_shutdown_, omp.omp_pause_resource_all)
        return None

    def set_blas_threads(self, n: int) -> None:
        if self._blas_get() != n:
            self._blas_set(n)

    def stop_omp_workers(self) -> None:
        self._omp_pause(_OMP_PAUSE_SOFT)  # the calling thread's team only


class OneRowBlas:
    """Owner of the process's CPU thread mode for one-row GEMMs (see the module docstring)."""

    def __init__(self, threads: Optional[_Threads]) -> None:
        self._threads = threads
        self._torch_threads: Optional[int] = None  # torch's count while entered, else None
        self._owner: Optional[int] = None  # the thread that entered: only it uses the mode
        self._lock = threading.Lock()
        self._arrays: dict[tuple, Optional[np.ndarray]] = {}  # see array_for

    @property
    def available(self) -> bool:
        return self._threads is not None

    @property
    def active(self) -> bool:
        """Entered by the calling thread."""
        return self._owner == threading.get_ident()

    def enter(self) -> None:
        """One-row GEMMs of the calling thread go to OpenBLAS with torch's threads from now on;
        its torch work runs on one thread. A no-op while another thread holds the mode (two
        engines stepping in two threads: the second keeps oneDNN)."""
        with self._lock:
            if self._threads is None or self._owner is not None:
                return
            self._owner = threading.get_ident()
        count = torch.get_num_threads()
        torch.set_num_threads(1)
        if count > 1:
            self._threads.stop_omp_workers()
        self._threads.set_blas_threads(count)
        self._torch_threads = count

    def leave(self) -> None:
        """Back to torch's threads, OpenBLAS's workers stopped (if the calling thread entered).
        OpenBLAS keeps torch's thread count (raising it back would start workers that spin)."""
        if not self.active:
            return
        count = self._torch_threads
        if count > 1:
            self._threads.stop_blas_workers()
        torch.set_num_threads(count)
        with self._lock:
            self._owner = self._torch_threads = None

    def array_for(self, x: torch.Tensor, weight: torch.Tensor) -> Optional[np.ndarray]:
        """The weight as a numpy array when this thread's mode computes x · weightᵀ (entered, x
        one fp32 row, the weight a contiguous 2-D fp32 CPU tensor), else None. Checked per call
        cheaply: an entry is keyed by everything that decides both the answer and the array
        (address, shape, strides, dtype), so a weight is inspected once.

        Not `weight.numpy()`: that marks the storage unresizable for good, and releasing memory
        resizes weight storages to 0. An array over the memory is read only while a tensor of
        that address and layout is passed in, i.e. lives there."""
        if (self._owner != threading.get_ident() or x.shape[0] != 1 or x.dim() != 2
                or x.dtype != torch.float32):
            return None
        key = (weight.data_ptr(), weight.shape, weight.stride(), weight.dtype)
        try:
            return self._arrays[key]
        except KeyError:
            if len(self._arrays) >= _MAX_ARRAYS:
                self._arrays.clear()
            array = self._arrays[key] = _array_over(weight)
            return array

    @staticmethod
    def gemv(x: torch.Tensor, array: np.ndarray, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [1, in] · weightᵀ (+ bias) → [1, out], `array` the weight's (`array_for`):
        OpenBLAS's sgemv on the weight in place."""
        out = torch.from_numpy(np.dot(array, x.numpy()[0])).unsqueeze(0)
        return out if bias is None else out.add_(bias)


def _array_over(weight: torch.Tensor) -> Optional[np.ndarray]:
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
            or not weight.is_contiguous()):
        return None
    pointer = ctypes.cast(weight.data_ptr(), ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(pointer, shape=tuple(weight.shape))


def _make() -> OneRowBlas:
    if os.environ.get("ROLLOUT_CPU_OPENBLAS", "1") == "0":
        return OneRowBlas(None)
    threads = _Threads.find()
    if threads is None:
        logger.info("no OpenBLAS under numpy or no pausable OpenMP under torch: "
                    "CPU one-row GEMMs stay on oneDNN")
    return OneRowBlas(threads)


ONE_ROW_BLAS = _make()
