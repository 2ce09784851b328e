"""Decode attention as a Gluon kernel that gathers a request's earlier keys and values into
shared memory with cp.async before its PDL wait (one program per request and KV head, no split).

Why: above 64 requests the Triton kernel (decode.py, one split of 128-key blocks) is bound by its
own latency — a program loads a block's slots, then its keys, then its values, twice for a
128 + 128-token context, and registers hold at most its first block before the wait. Here the
ring of shared memory holds NBUF blocks of keys and values (up to ~110 KB, two programs an SM),
all their copies in flight at once, issued while the kernels before this one run; the new
token's key and value (this step's qkv kernel writes them) are read after the wait, beside q.
Contexts longer than the ring refill its slots as they are consumed.

Experimental (ROLLOUT_GLUON_DECODE_ATTN = "block_n,nbuf,warps"; bf16, head_dim 128, one split):
Gluon does not run under the CPU interpreter, so its spec is GPU-only
(tests/test_decode_gluon.py).

Rounding: as decode.py's kernel — scores q·k (bf16 products, fp32 sums) times sm_scale, an
online softmax in fp32 over blocks of BLOCK_N keys, probabilities rounded to the dtype before
p·v; the new key's score and value enter as fp32 sums of the same products."""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch

from rollout.triton_pdl import launch_options


class GluonDecodeConfig(NamedTuple):
    block_n: int = 32
    nbuf: int = 6
    num_warps: int = 4

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        return 2 * self.nbuf * self.block_n * head_dim * itemsize + self.nbuf * self.block_n * 4


def config_from_env() -> Optional[GluonDecodeConfig]:
    spec = os.environ.get("ROLLOUT_GLUON_DECODE_ATTN", "")
    if spec in ("", "0"):
        return None
    return GluonDecodeConfig(*(int(v) for v in spec.split(",")))


def supports(q: torch.Tensor, k_buffer: torch.Tensor, config: GluonDecodeConfig) -> bool:
    return (q.is_cuda and q.dtype == torch.bfloat16 and k_buffer.dtype == q.dtype
            and q.shape[-1] == 128 and k_buffer.stride(-1) == 1 and q.stride(-1) == 1
            and config.smem_bytes(128, 2) <= 220 * 1024
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


@functools.lru_cache(maxsize=None)
def _kernel():
    """Built on first use: Gluon needs a GPU build of Triton."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    import triton.language as tl

    @gluon.jit
    def _issue(k_all, v_all, slots, K, V, kv_head, stride_kt, stride_kh, stride_vt, stride_vh,
               blk, ring_slot, n_old, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               LOAD: gl.constexpr):
        """cp.async of block `blk`'s earlier keys and values (at `slots`) into ring slot
        `ring_slot`; keys at or past n_old are zero-filled."""
        offs_n = blk * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
        slots = slots.to(gl.int64)
        old = (offs_n < n_old)[:, None]
        async_copy.async_copy_global_to_shared(
            k_all.index(ring_slot),
            K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=old)
        async_copy.async_copy_global_to_shared(
            v_all.index(ring_slot),
            V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=old)

    @gluon.jit
    def decode_kernel(Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, O, sm_scale,
                      stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_r2t, stride_ob, stride_oh,
                      GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_H: gl.constexpr,
                      BLOCK_N: gl.constexpr, NBUF: gl.constexpr, NBUF_P2: gl.constexpr,
                      NUM_WARPS: gl.constexpr, USE_PDL: gl.constexpr):
        b = gl.program_id(0)
        kv_head = gl.program_id(1)
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        RING: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0],
                                                       warps_per_cta=[1, NUM_WARPS],
                                                       instr_shape=[16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        KV_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8,
                                                        order=[1, 0])
        SLOT_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                          order=[0])

        k_all = gl.allocate_shared_memory(K.dtype.element_ty, [NBUF, BLOCK_N, HEAD_DIM], KV_SMEM)
        v_all = gl.allocate_shared_memory(V.dtype.element_ty, [NBUF, BLOCK_N, HEAD_DIM], KV_SMEM)
        slots_smem = gl.allocate_shared_memory(gl.int32, [NBUF_P2 * BLOCK_N], SLOT_SMEM)

        # Before the PDL wait: the step's inputs (written before its first kernel) and the
        # earlier keys and values (earlier steps wrote them)
        seq_len = gl.load(SeqLens + b).to(gl.int32)
        row_base = gl.load(ReqPoolIdx + b).to(gl.int64) * stride_r2t
        n_old = seq_len - 1
        nblocks = (seq_len + BLOCK_N - 1) // BLOCK_N
        # the ring's first fill: every block's slots in one load, staged in shared memory
        offs_ring = gl.arange(0, NBUF_P2 * BLOCK_N, layout=RING)
        ring_slots = gl.load(ReqToToken + row_base + offs_ring,
                             mask=offs_ring < gl.minimum(n_old, NBUF * BLOCK_N), other=0)
        slots_smem.store(ring_slots)
        new_slot = gl.load(ReqToToken + row_base + n_old).to(gl.int64)
        gl.thread_barrier()
        for s in gl.static_range(NBUF):
            if s < nblocks:
                slots = slots_smem.slice(s * BLOCK_N, BLOCK_N).load(gl.SliceLayout(1, LOAD))
                _issue(k_all, v_all, slots, K, V, kv_head, stride_kt, stride_kh, stride_vt,
                       stride_vh, s, s, n_old, BLOCK_N, HEAD_DIM, LOAD)
            async_copy.commit_group()

        if USE_PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        if USE_PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()

        offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD))
        h_mask = (offs_h < GROUP)[:, None]
        q = gl.load(Q + b * stride_qb + (kv_head * GROUP + offs_h)[:, None] * stride_qh
                    + offs_d[None, :], mask=h_mask, other=0.0)
        k_new = gl.load(K + new_slot * stride_kt + kv_head * stride_kh + offs_d)
        s_new = gl.sum(q.to(gl.float32) * k_new.to(gl.float32)[None, :], axis=1)
        s_new = gl.convert_layout(s_new, gl.SliceLayout(1, MMA)) * sm_scale
        q_op = gl.convert_layout(q, A_OP)
        offs_dm = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, MMA))
        v_new = gl.load(V + new_slot * stride_vt + kv_head * stride_vh + offs_dm).to(gl.float32)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, MMA))
        l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, MMA))
        acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, MMA)
        for i in range(nblocks):
            ring_slot = i % NBUF
            async_copy.wait_group(NBUF - 1)
            gl.thread_barrier()
            k_t = k_all.index(ring_slot).permute([1, 0]).load(B_OP)
            scores = mma_v2(q_op, k_t, gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA)) * sm_scale
            offs_n = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
            is_new = (offs_n == n_old)[None, :]
            scores = gl.where(is_new, s_new[:, None], scores)
            scores = gl.where((offs_n < seq_len)[None, :], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, 1))
            alpha = gl.exp(m_i - m_new)
            p = gl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p_lo = p.to(V.dtype.element_ty)
            v = v_all.index(ring_slot).load(B_OP)
            pv = mma_v2(gl.convert_layout(p_lo, A_OP), v,
                        gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, MMA))
            p_new = gl.sum(gl.where(is_new, p_lo.to(gl.float32), 0.0), 1)
            acc = acc * alpha[:, None] + pv + p_new[:, None] * v_new[None, :]
            nxt = i + NBUF
            gl.thread_barrier()  # every warp is done with the ring slot before it refills
            if nxt < nblocks:
                offs_next = nxt * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
                slots = gl.load(ReqToToken + row_base + offs_next, mask=offs_next < n_old,
                                other=0)
                _issue(k_all, v_all, slots, K, V, kv_head, stride_kt, stride_kh,
                       stride_vt, stride_vh, nxt, ring_slot, n_old, BLOCK_N, HEAD_DIM, LOAD)
            async_copy.commit_group()
        async_copy.wait_group(0)

        out = (acc / l_i[:, None]).to(O.dtype.element_ty)
        offs_hm = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, MMA))
        gl.store(O + b * stride_ob + (kv_head * GROUP + offs_hm)[:, None] * stride_oh
                 + offs_dm[None, :], out, mask=(offs_hm < GROUP)[:, None])

    return decode_kernel


def decode_attention_gluon(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           seq_lens: torch.Tensor, sm_scale: float, out: torch.Tensor,
                           group: int, config: GluonDecodeConfig) -> torch.Tensor:
    """decode.py's `decode_attention` with one split, by the Gluon kernel (q [batch, heads,
    128] bf16; seq_lens[b] >= 1)."""
    batch, heads, head_dim = q.shape
    block_h = max(16, 1 << (group - 1).bit_length())
    _kernel()[(batch, k_buffer.shape[1])](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_N=config.block_n,
        NBUF=config.nbuf, NBUF_P2=1 << (config.nbuf - 1).bit_length(), NUM_WARPS=config.num_warps, num_warps=config.num_warps,
        **launch_options())
    return out
