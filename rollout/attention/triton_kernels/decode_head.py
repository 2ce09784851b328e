"""Decode attention with one program per (request, query head, KV split): at short contexts one
program per query head holds all of the request's keys, with no merge kernel.

The split kernel (decode.py) shares one read of a KV head's keys among its query heads through
tl.dot, and at small batches splits the keys so that enough programs run, which costs a second
kernel that merges the splits. Here each query head is its own program and reads its KV head's
keys itself (the other heads of its group read the same keys from the L2): at one request that
is 12 programs instead of 2 KV heads × splits + the merge. The first BLOCK_N earlier keys (all
but the new token's, which this step's qkv kernel writes) load before the PDL wait, so a context
of up to BLOCK_N + 1 keys is in registers when the wait returns and the first split does it all
(the other splits exit at once). A longer context is split SPLITS ways (each split's first block
preloaded); every split leaves its normalised partial and log-sum-exp and counts itself in on
the (request, head)'s arrival counter, and the last to arrive merges the splits in split order
(the result does not depend on the order of arrival) and sets the counter back to 0 for the next
launch. The scores are FMA dot products over the head dim (one query row: no tensor-core
padding), in base 2 with the scale folded into the query.

Contract as decode.py's: seq_lens[b] >= 1; request b's token j at slot req_to_token[row_b, j]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.attention.triton_kernels.common import merge_partial
from rollout.triton_pdl import launch_options, pdl_wait

LOG2E = 1.4426950408889634


@triton.jit
def _gather(Buf, slots, kv_head, stride_t, stride_h, offs_d, d_mask, mask):
    """Rows of one KV head at `slots` (where `mask`) as [BLOCK_N, BLOCK_D] (zeros elsewhere)."""
    return tl.load(Buf + slots[:, None] * stride_t + kv_head * stride_h + offs_d[None, :],
                   mask=mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _merge(part, lse_ptr, offs_d, d_mask, stride_ps, NUM_SPLITS: tl.constexpr):
    """The splits' partials (normalised outputs, log2-sum-exps) combined in split order; read
    past the L1 (other SMs wrote them)."""
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros(offs_d.shape, tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        lse = tl.load(lse_ptr + split, cache_modifier=".cg")
        o = tl.load(part + split * stride_ps + offs_d, mask=d_mask, other=0.0,
                    cache_modifier=".cg")
        m_i, l_i, acc = merge_partial(m_i, l_i, acc, lse, o, True)
    return acc / l_i


@triton.jit
def _decode_head_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, O, PartO, PartLse, Arrivals, qk_scale,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ab,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # Before the PDL wait: the step's inputs (written before its first kernel) and the split's
    # first block of earlier keys (earlier steps wrote them; no kernel of this step does)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    n_old = seq_len - 1  # keys before the new token's
    split_len = tl.cdiv(n_old, NUM_SPLITS)
    long = n_old > BLOCK_N
    start = tl.where(long, split * split_len, 0)
    end = tl.where(long, tl.minimum(start + split_len, n_old), tl.where(split == 0, n_old, 0))
    if long | (split == 0):  # a short context's other splits have nothing to do
        row = tl.load(ReqPoolIdx + b).to(tl.int64)
        table = ReqToToken + row * stride_r2t
        offs = start + offs_n
        mask = offs < end
        # int64: slot * stride can pass 2**31 in a large pool
        slots = tl.load(table + offs, mask=mask, other=0).to(tl.int64)
        k = _gather(K, slots, kv_head, stride_kt, stride_kh, offs_d, d_mask, mask)
        v = _gather(V, slots, kv_head, stride_vt, stride_vh, offs_d, d_mask, mask)
        new_slot = tl.load(table + n_old).to(tl.int64)
        pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
        q = tl.load(Q + b * stride_qb + head * stride_qh + offs_d, mask=d_mask, other=0.0)
        q = q.to(tl.float32) * qk_scale  # scores come out in log2 units
        s = tl.where(mask, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
        m_i = tl.max(s, 0)
        if split == 0:  # the new token's score and value beside the block's (not swapped into
            # its [N, D] tiles: that would hold a second copy of them in registers)
            k_new = tl.load(K + new_slot * stride_kt + kv_head * stride_kh + offs_d, mask=d_mask,
                            other=0.0)
            v_new = tl.load(V + new_slot * stride_vt + kv_head * stride_vh + offs_d, mask=d_mask,
                            other=0.0)
            s_new = tl.sum(k_new.to(tl.float32) * q, 0)
            m_i = tl.maximum(m_i, s_new)
            p_new = tl.exp2(s_new - m_i)
            l_i = p_new
            acc = p_new * v_new.to(tl.float32)
        else:
            l_i = 0.0
            acc = tl.zeros([BLOCK_D], tl.float32)
        p = tl.where(mask, tl.exp2(s - m_i), 0.0)  # an empty split's m_i is -inf
        l_i += tl.sum(p, 0)
        acc += tl.sum(p[:, None] * v.to(tl.float32), 0)
        for n0 in range(start + BLOCK_N, end, BLOCK_N):  # the split's further blocks
            offs = n0 + offs_n
            mask = offs < end
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
        out_ptr = O + b * stride_ob + head * stride_oh + offs_d
        if long:
            part = PartO + b * stride_pb + head * stride_ph
            lse_ptr = PartLse + b * stride_lb + head * stride_lh
            # an empty split (more splits than keys) weighs 0 in the merge
            tl.store(part + split * stride_ps + offs_d, tl.where(l_i > 0, acc / l_i, 0.0),
                     mask=d_mask)
            tl.store(lse_ptr + split, m_i + tl.log2(l_i))
            # every thread's partial stores before the one release below; the last program's
            # reads after its acquire
            tl.debug_barrier()
            arrived = tl.atomic_add(Arrivals + b * stride_ab + head, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:
                tl.atomic_xchg(Arrivals + b * stride_ab + head, 0, sem="relaxed")
                out = _merge(part, lse_ptr, offs_d, d_mask, stride_ps, NUM_SPLITS)
                tl.store(out_ptr, out.to(O.dtype.element_ty), mask=d_mask)
        else:
            tl.store(out_ptr, (acc / l_i).to(O.dtype.element_ty), mask=d_mask)


def decode_attention_per_head(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                              req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                              seq_lens: torch.Tensor, sm_scale: float, out: torch.Tensor,
                              scratch, group: int, block_d: int, config) -> torch.Tensor:
    """Launch over (requests, query heads, splits) into `out`; `scratch`: decode.DecodeScratch
    with room for the batch, heads and splits (checked by the caller)."""
    batch, heads, head_dim = q.shape
    part_o, part_lse, arrivals = scratch
    _decode_head_kernel[(batch, heads, config.splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out, part_o, part_lse,
        arrivals, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), arrivals.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=config.block_n,
        NUM_SPLITS=config.splits, num_warps=config.num_warps, num_stages=config.num_stages,
        **launch_options())
    return out
