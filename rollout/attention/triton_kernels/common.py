"""Small helpers shared by the decode and extend kernels: launch-time ones and the merge of a
split's partial result."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def block_dmodel(head_dim: int) -> int:
    """Padded head dim: a power of two (tl.arange needs one), at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to tf32 on the GPU (parity with the fp32 reference);
    the flag does nothing for bf16/fp16 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_kv(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> int:
    """Validate shapes; returns the number of query heads per KV head."""
    heads, kv_heads = q.shape[1], k_buffer.shape[1]
    if heads % kv_heads or q.shape[2] != k_buffer.shape[2] or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit KV buffers {tuple(k_buffer.shape)} "
                         f"/ {tuple(v_buffer.shape)}")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("q and the KV buffers must be contiguous in head_dim")
    return heads // kv_heads


@triton.jit
def merge_partial(m_i, l_i, acc, lse, part, BASE2: tl.constexpr):
    """Fold one split's normalised partial output `part` with log-sum-exp `lse` (natural log,
    or log2 if BASE2) into the running (max, sum, weighted output); returns the new three."""
    m_new = tl.maximum(m_i, lse)
    if BASE2:
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
    else:
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(lse - m_new)
    acc = acc * alpha + w * part  # before l_i: the FMAs the merge kernel compiled to before
    l_i = l_i * alpha + w
    return m_new, l_i, acc
