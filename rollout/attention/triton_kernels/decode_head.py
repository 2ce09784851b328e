"""Decode attention with one program per (request, query head): all of the request's keys in
one program, so there are no partial results and no merge kernel.

The split kernel (decode.py) shares one read of a KV head's keys among its query heads through
tl.dot, and at small batches splits the keys so that enough programs run, which costs a second
kernel that merges the splits. Here each query head is its own program and reads its KV head's
keys itself (the other heads of its group read the same keys from the L2): at one request that
is 12 programs instead of 2 KV heads × splits + the merge. The first BLOCK_N keys but the new
token's (written by this step's qkv kernel) load before the PDL wait, so a context that fits in
one block is in registers when the wait returns; the scores are FMA dot products over the head
dim (one query row: no tensor-core padding), the softmax is in base 2 with the scale folded into
the query, and longer contexts continue block by block with the online softmax.

Contract as decode.py's: seq_lens[b] >= 1; request b's token j at slot req_to_token[row_b, j]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.triton_pdl import launch_options, pdl_wait

LOG2E = 1.4426950408889634


@triton.jit
def _gather(Buf, slots, kv_head, stride_t, stride_h, offs_d, d_mask, mask):
    """Rows of one KV head at `slots` (where `mask`) as [BLOCK_N, BLOCK_D] (zeros elsewhere)."""
    return tl.load(Buf + slots[:, None] * stride_t + kv_head * stride_h + offs_d[None, :],
                   mask=mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _decode_head_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, O, qk_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # Before the PDL wait: the step's inputs (written before its first kernel) and the first
    # block's earlier keys and values (earlier steps wrote them; no kernel of this step does)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    table = ReqToToken + row * stride_r2t
    old = offs_n < seq_len - 1  # the first block's keys but the new token's
    # int64: slot * stride can pass 2**31 in a large pool
    slots = tl.load(table + offs_n, mask=old, other=0).to(tl.int64)
    k = _gather(K, slots, kv_head, stride_kt, stride_kh, offs_d, d_mask, old)
    v = _gather(V, slots, kv_head, stride_vt, stride_vh, offs_d, d_mask, old)
    new_slot = tl.load(table + seq_len - 1).to(tl.int64)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    q = tl.load(Q + b * stride_qb + head * stride_qh + offs_d, mask=d_mask, other=0.0)
    q = q.to(tl.float32) * qk_scale  # scores come out in log2 units
    k_new = tl.load(K + new_slot * stride_kt + kv_head * stride_kh + offs_d, mask=d_mask, other=0.0)
    v_new = tl.load(V + new_slot * stride_vt + kv_head * stride_vh + offs_d, mask=d_mask, other=0.0)
    # the new token's score and value beside the block's (not swapped into its [N, D] tiles:
    # that would hold a second copy of them in registers)
    s_new = tl.sum(k_new.to(tl.float32) * q, 0)
    s = tl.where(old, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
    m_i = tl.maximum(tl.max(s, 0), s_new)
    p = tl.exp2(s - m_i)
    p_new = tl.exp2(s_new - m_i)
    l_i = tl.sum(p, 0) + p_new
    acc = tl.sum(p[:, None] * v.to(tl.float32), 0) + p_new * v_new.to(tl.float32)
    for n0 in range(BLOCK_N, seq_len - 1, BLOCK_N):  # the earlier keys past the first block
        offs = n0 + offs_n
        mask = offs < seq_len - 1
        slots = tl.load(table + offs, mask=mask, other=0).to(tl.int64)
        k = _gather(K, slots, kv_head, stride_kt, stride_kh, offs_d, d_mask, mask)
        v = _gather(V, slots, kv_head, stride_vt, stride_vh, offs_d, d_mask, mask)
        s = tl.where(mask, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    tl.store(O + b * stride_ob + head * stride_oh + offs_d,
             (acc / l_i).to(O.dtype.element_ty), mask=d_mask)


def decode_attention_per_head(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                              req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                              seq_lens: torch.Tensor, sm_scale: float, out: torch.Tensor,
                              group: int, block_d: int, block_n: int, num_warps: int,
                              num_stages: int) -> torch.Tensor:
    """Launch over (requests, query heads) into `out` (shapes checked by the caller)."""
    batch, heads, head_dim = q.shape
    _decode_head_kernel[(batch, heads)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages, **launch_options())
    return out
