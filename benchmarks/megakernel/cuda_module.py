"""A CUDA C++ kernel compiled at run time with NVRTC (the library torch's CUDA wheels ship) or
taken from a prebuilt cubin, loaded and launched through the driver API with ctypes — so it
runs on the current torch stream and is captured by CUDA graphs like any torch op."""
from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence

import torch

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA error {rc} ({(msg.value or b'').decode()})")


def nvrtc_compile(source: str, name: str, arch: str, defines: dict[str, object]) -> bytes:
    """cubin of `source` for `arch` (e.g. sm_90a) with -D defines, by NVRTC."""
    from torch.cuda._utils import _get_nvrtc_library
    lib = _get_nvrtc_library()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0,
                                None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram: {rc}")
    opts = [f"--gpu-architecture={arch}", "-default-device", "-std=c++17"]
    opts += [f"-D{k}={v}" for k, v in defines.items()]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(f"NVRTC failed ({rc}):\n{log.value.decode(errors='replace')}")
    size = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


class CudaKernel:
    """One __global__ function of a loaded cubin."""

    def __init__(self, cubin: bytes, name: str, dynamic_smem: int = 0):
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the primary context is current on this thread
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._image = ctypes.create_string_buffer(cubin, len(cubin))
        self.module = ctypes.c_void_p()
        _check(self.lib, self.lib.cuModuleLoadData(ctypes.byref(self.module), self._image),
               "cuModuleLoadData")
        self.func = ctypes.c_void_p()
        _check(self.lib, self.lib.cuModuleGetFunction(ctypes.byref(self.func), self.module,
                                                      name.encode()), f"cuModuleGetFunction {name}")
        self.dynamic_smem = dynamic_smem
        if dynamic_smem >= 48 * 1024:
            _check(self.lib, self.lib.cuFuncSetAttribute(
                self.func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_smem),
                "cuFuncSetAttribute")

    def attribute(self, attr: int) -> int:
        v = ctypes.c_int()
        _check(self.lib, self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, self.func),
               "cuFuncGetAttribute")
        return v.value

    def max_blocks_per_sm(self, threads: int) -> int:
        n = ctypes.c_int()
        _check(self.lib, self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), self.func, threads, ctypes.c_size_t(self.dynamic_smem)),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return n.value

    def launch(self, grid: int, block: int, args: Sequence[object],
               stream: Optional[torch.cuda.Stream] = None) -> None:
        """args: tensors (their pointers), ints (C int) or ctypes values."""
        held = []
        for a in args:
            if isinstance(a, torch.Tensor):
                held.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, int):
                held.append(ctypes.c_int(a))
            else:
                held.append(a)
        argv = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                                for v in held])
        s = (stream or torch.cuda.current_stream()).cuda_stream
        _check(self.lib, self.lib.cuLaunchKernel(
            self.func, grid, 1, 1, block, 1, 1, self.dynamic_smem, ctypes.c_void_p(s), argv, None),
            "cuLaunchKernel")


def cubin_for(source_path: str, name: str, defines: dict[str, object],
              cubin_path: Optional[str] = None) -> tuple[bytes, str]:
    """(cubin, how it was built): NVRTC first, else the prebuilt cubin."""
    src = open(source_path).read()
    try:
        return nvrtc_compile(src, name, "sm_90a", defines), "nvrtc"
    except Exception as e:  # noqa: BLE001 — fall back to the prebuilt binary, and say so
        if cubin_path is None or not os.path.exists(cubin_path):
            raise
        return open(cubin_path, "rb").read(), f"cubin ({type(e).__name__}: {str(e)[:200]})"
