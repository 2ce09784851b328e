"""Compile the Gluon probe's kernels for sm_90 on a machine without a GPU, before spending device
time: every variant of benchmarks/gluon_gate_up_probe.py through the JIT's `warmup` with a stub
driver that names an H200's target. Prints each variant's shared memory, whether the compiler
split the warps (`setmaxnreg`), and its wgmma, atomic and barrier instruction counts. With
`--engine`: the engine's Gluon GEMM (rollout/layers/gluon_gemm.py) at its table entries
(gate/up, qkv) and the variants its A/Bs try, under each PDL mode.

Use the device's Triton (3.6, pinned by its torch), installed beside this machine's:

  python -m pip install --no-deps --target /tmp/t36 triton==3.6.0
  PYTHONPATH=/tmp/t36:. python benchmarks/compile_sm90.py [--engine | --decode]

`--decode`: the decode attention's split kernel at the engine's launches (registers and spills
a program, by ptxas; async copies before the PDL wait).
"""
from __future__ import annotations

import torch
import triton
from triton.runtime import driver

from tests.helpers import H200CompileTarget  # a stub driver naming an H200


def main() -> None:
    driver.set_active(H200CompileTarget())
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from benchmarks import gluon_gate_up_probe as probe
    m, inter, k = probe.M_ROWS, probe.INTER, probe.HIDDEN
    x = torch.empty(m, k, dtype=torch.bfloat16)
    w = torch.empty(2 * inter, k, dtype=torch.bfloat16)
    y = torch.empty(m, inter, dtype=torch.bfloat16)
    print(f"triton {triton.__version__}")
    for variant in probe.VARIANTS:
        bm, bn, bk, stages, coalesce, programs, tiles = variant
        if tiles == probe.X_ON_M:  # the engine's kernel: --engine
            continue
        x_desc = TensorDescriptor.from_tensor(
            x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16))
        w_desc = TensorDescriptor.from_tensor(
            w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16))
        n_tiles = triton.cdiv(m, bm) * triton.cdiv(inter, bn)
        meta = dict(BM=bm, BN=bn, BK=bk, STAGES=stages, PRODUCER_REGS=40, num_warps=4,
                    grid=(programs or n_tiles,))
        if tiles == probe.STREAM_K:
            work = torch.empty(n_tiles * 2 * bn * bm, dtype=torch.float32)
            flags = torch.zeros(n_tiles, dtype=torch.int32)
            kernel = probe.gate_up_silu_stream_k.warmup(x_desc, w_desc, y, work, flags, m,
                                                        inter, k, **meta)
        else:
            kernel = probe.gate_up_silu_ws.warmup(x_desc, w_desc, y, m, inter, k, n_tiles,
                                                  COALESCE=coalesce, **meta)
        ptx = kernel.asm["ptx"]
        print(f"{(bm, bn, bk, stages, programs, tiles)}: shared {kernel.metadata.shared} B, "
              f"setmaxnreg {'setmaxnreg' in ptx}, wgmma {ptx.count('wgmma.mma_async')}, "
              f"atomics {ptx.count('atom.')}, barriers {ptx.count('bar.sync')}", flush=True)


def engine_kernel() -> None:
    """The engine's Gluon GEMM (rollout/layers/gluon_gemm.py): the gate/up and qkv table
    entries and the variants their A/Bs try, and down split along K, under each PDL mode;
    prints whether the PTX waits (griddepcontrol)."""
    from rollout.layers import gluon_gemm as g
    from rollout.layers.gemv_launch import Config, _config
    gate_up = _config(128, 17920, 1536, True)
    qkv = _config(128, 2048, 1536)
    down = Config(128, 64, 11, 8, True, 6, 128, preload=3, gluon=True)
    shapes = {"gate/up": (17920, 1536), "qkv": (2048, 1536), "down": (1536, 8960)}
    cases = [("gate/up", gate_up, 2), ("gate/up", gate_up, 1), ("gate/up", gate_up, 0),
             ("gate/up", gate_up._replace(preload=0), 2),
             ("gate/up", gate_up._replace(num_warps=4), 2),
             ("gate/up", gate_up._replace(block_n=64), 2),
             ("gate/up", gate_up._replace(num_stages=4, preload=4), 2),
             ("gate/up", gate_up._replace(block_m=64, num_warps=4), 2),
             ("qkv", qkv, 2), ("qkv", qkv, 0), ("qkv", qkv._replace(num_warps=4), 2),
             ("down", down, 2), ("down", down, 0),
             ("down", down._replace(block_n=96, split_k=8), 2),
             ("down", down._replace(split_k=1), 2)]
    for name, cfg, pdl in cases:
        gated = name == "gate/up"
        n, k = shapes[name]
        x = torch.empty(128, k, dtype=torch.bfloat16)
        w = torch.empty(n, k, dtype=torch.bfloat16)
        y = torch.empty(128, n // 2 if gated else n, dtype=torch.bfloat16)
        kernel = g.compile_for_sm90(x, w, y, gated, cfg, pdl)
        ptx = kernel.asm["ptx"]
        print(f"engine {name} {cfg.block_n} rows, split "
              f"{cfg.split_k}, {cfg.num_warps} warps, {cfg.num_stages} stages, preload "
              f"{cfg.preload}, PDL {pdl}: shared {kernel.metadata.shared} B, wgmma "
              f"{ptx.count('wgmma.mma_async')}, waits {ptx.count('griddepcontrol.wait')}, "
              f"triggers {ptx.count('griddepcontrol.launch_dependents')}", flush=True)


def decode_kernel() -> None:
    """The decode attention's split kernel (rollout/attention/triton_kernels/decode.py) at the
    engine's launches for Qwen2-1.5B's heads: registers, spills and shared memory a program,
    and its async copies before / after the PDL wait. With the engine's strides: Triton
    specializes multiples of 16, and unit strides compile another kernel (no vector gathers)."""
    from rollout.attention.triton_kernels import decode as dk
    heads, kv_heads, d, slots = 12, 2, 128, 4096
    cases = [(b, dk.decode_launch_config(b, kv_heads=kv_heads)) for b in (32, 128, 256)]
    for batch, cfg in cases:
        q = torch.empty(batch, heads, d, dtype=torch.bfloat16)
        kv = torch.empty(slots, kv_heads, d, dtype=torch.bfloat16)
        idx = torch.empty(batch, dtype=torch.int64)
        part = torch.empty(batch, heads, cfg.splits, d)
        strides = (heads * d, d, kv_heads * d, d, kv_heads * d, d, 4096, heads * d, d, 0,
                   heads * cfg.splits, cfg.splits)
        kernel = dk._decode_partial_kernel.warmup(
            q, kv, kv, torch.empty(batch, 4096, dtype=torch.int32), idx, idx, part, part, 0.088,
            *strides, GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_D=d, BLOCK_H=16,
            BLOCK_N=cfg.block_n, NUM_SPLITS=cfg.splits, PRECISION="tf32",
            PRELOAD_KV=cfg.preload_kv, USE_PDL=True, PREFETCH_ROW_BYTES=0,
            PREFETCH_KEYS=dk.PREFETCH_KEYS,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            grid=(batch, kv_heads, cfg.splits))
        ptx = kernel.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        print(f"decode batch {batch} {cfg}: shared {kernel.metadata.shared} B, "
              f"{_ptxas_usage(ptx)}, async copies before / after the wait "
              f"{ptx[:wait].count('cp.async.cg')} / {ptx[wait:].count('cp.async.cg')}",
              flush=True)


def _ptxas_usage(ptx: str) -> str:
    """ptxas's resource line (registers, spill stores and loads) for sm_90a PTX, by Triton's
    own ptxas."""
    import os
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia import compiler
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([compiler.get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o",
                              os.devnull], capture_output=True, text=True)
    text = run.stderr + run.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"registers {regs.group(1) if regs else '?'}, spill stores/loads "
            f"{spills.groups() if spills else '?'}")


if __name__ == "__main__":
    import sys
    if "--decode" in sys.argv:
        driver.set_active(H200CompileTarget())
        decode_kernel()
    elif "--engine" in sys.argv:
        driver.set_active(H200CompileTarget())
        engine_kernel()
    else:
        main()
