"""One launch that writes a step's new keys and values into a layer's paged KV buffers.

Indexed assignment (`k_buffer[loc] = k`, then the same for v) costs two index kernels of a few
microseconds each, per layer and step; this kernel does both stores at once, casting to the
buffer's dtype. One program per token copies its kv_heads * head_dim keys and values (the rows of
k and v are contiguous inside: they are views of the fused QKV projection)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.triton_pdl import launch_options, pdl_wait


@triton.jit
def _store_kv_kernel(K, V, Loc, KBuf, VBuf, stride_k, stride_v, stride_kb, stride_vb,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + t * stride_k + offs, mask=mask)
    v = tl.load(V + t * stride_v + offs, mask=mask)
    tl.store(KBuf + slot * stride_kb + offs, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + slot * stride_vb + offs, v.to(VBuf.dtype.element_ty), mask=mask)


def rows_are_flat(t: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] whose heads * head_dim values per token are contiguous."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def store_kv(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, k_buffer: torch.Tensor,
             v_buffer: torch.Tensor) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v (k, v: [tokens, kv_heads, head_dim])."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(tokens,)](k, v, loc, k_buffer, v_buffer, k.stride(0), v.stride(0),
                                k_buffer.stride(0), v_buffer.stride(0), ROW=row,
                                BLOCK=triton.next_power_of_2(row), num_warps=1 if row <= 256 else 4,
                                **launch_options())
