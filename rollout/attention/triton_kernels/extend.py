"""Extend (prefill) attention over the paged KV cache.

Request b computes extend_seq_lens[b] new tokens after extend_prefix_lens[b] cached ones; its
queries sit at rows extend_start_loc[b]... of the flat q. The new tokens' KV is already in the
pool (the backend writes it before attending), so every key, prefix or new, is read through
req_to_token, and new token i (absolute position prefix + i) sees keys 0..prefix + i.

One program per (request, head, block of BLOCK_M new tokens), flash-attention style online
softmax over blocks of BLOCK_N keys; programs past a request's last block exit at once, so the
grid can be sized by the longest extend in the batch. `ExtendConfig.packed`: one program per
(request, KV head, block) instead, its rows the block's tokens of every query head of that KV
head (GQA: Qwen2-1.5B has 6, padded to 8), so each key and value block is loaded once for the
group rather than once per query head; a row's sums are the unpacked kernel's (bit for bit in
16-bit; fp32's FMA dot may add in another order). `ExtendBlocks`: the (request, block) pairs as
a device table instead, one program each, for a CUDA graph's batch (its grid is fixed at
capture, so sized by requests × longest extend it would be its padded request count × its
token count: up to 262k programs of which a few thousand work)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from rollout.attention.triton_kernels.common import block_dmodel, check_kv, dot_precision


# the per-request rows are views into a step's packed indices, at offsets that go with its
# request count: not specialized on alignment (one variant for every batch; they load scalars)
@triton.jit(do_not_specialize_on_alignment=["ReqPoolIdx", "StartLoc", "ExtLens", "PrefixLens",
                                            "BlockReq", "BlockM"])
def _extend_kernel(
    Q, K, V, O, ReqToToken, ReqPoolIdx, StartLoc, ExtLens, PrefixLens, BlockReq, BlockM, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PACKED: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_TABLE: tl.constexpr,
):
    if BLOCK_TABLE:  # (request, block) of this program from the table; unused ones: past the end
        b = tl.load(BlockReq + tl.program_id(0)).to(tl.int32)
        m_block = tl.load(BlockM + tl.program_id(0)).to(tl.int32)
    else:
        b = tl.program_id(0)
        m_block = tl.program_id(2)
    ext_len = tl.load(ExtLens + b).to(tl.int32)
    if m_block * BLOCK_M < ext_len:
        if PACKED:  # rows: query head g of this KV head × token i of the block, g-major
            kv_head = tl.program_id(1)
            rows = tl.arange(0, GROUP_PAD * BLOCK_M)
            heads = kv_head * GROUP + rows // BLOCK_M
            offs_m = m_block * BLOCK_M + rows % BLOCK_M
            m_mask = (rows // BLOCK_M < GROUP) & (offs_m < ext_len)
        else:
            kv_head = tl.program_id(1) // GROUP
            offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            heads = tl.program_id(1) + 0 * offs_m
            m_mask = offs_m < ext_len
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        q_start = tl.load(StartLoc + b).to(tl.int64)
        row = tl.load(ReqPoolIdx + b).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q_rows = q_start + offs_m
        q = tl.load(Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = prefix + offs_m  # absolute position of each query token
        kv_end = prefix + tl.minimum((m_block + 1) * BLOCK_M, ext_len)  # causal: nothing later
        m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
        l_i = tl.zeros([q.shape[0]], tl.float32)
        acc = tl.zeros([q.shape[0], BLOCK_D], tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < kv_end
            slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=n_mask, other=0).to(tl.int64)
            k_t = tl.load(K + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                          mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            s = tl.dot(q, k_t, input_precision=PRECISION) * sm_scale
            allowed = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            # key 0 is allowed for every query, so m_new is finite from the first block on
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


class ExtendConfig(NamedTuple):
    """Launch parameters of the extend kernel (any value gives the same function; the rounding
    can differ with `block_n`, the online softmax's blocks)."""
    block_m: int = 64  # new tokens a program
    block_n: int = 64  # keys a step
    num_warps: int = 8
    num_stages: int = 3
    packed: bool = False  # a program takes every query head of a KV head (block_m tokens each)


def extend_config(head_dim: int, dtype: torch.dtype, group: int = 1) -> ExtendConfig:
    """The launch for a head size, dtype and GQA group (query heads a KV head). Rows of 129-256
    bytes (head_dim 128 in bf16/fp16): 32 keys a step and 4 warps, measured on an H200
    (`benchmarks/gpu_extend.py`, Qwen2-1.5B heads, fresh 128-token prompts, µs per call in a
    graph): 64 requests 74.5 -> 40.3, one request 7.7 -> 7.4 (the previous 64 keys and 8 warps);
    with a group, its query heads packed, 8 tokens a head (twentieth session: 64 requests
    40.1 -> 34.2, one request 7.4 -> 5.9; 16 tokens 36.6 / 7.5). Wider rows (big heads, fp32) take
    smaller tiles, so that the pipelined K/V tiles still fit in shared memory."""
    row_bytes = block_dmodel(head_dim) * torch.empty(0, dtype=dtype).element_size()
    if row_bytes > 256:
        return ExtendConfig(32, 32, 4 if head_dim <= 64 else 8)
    if row_bytes > 128:
        # tl.dot takes 16 rows at least: 8 tokens of a group of two or more
        return ExtendConfig(8, 32, 4, 2, True) if group >= 2 else ExtendConfig(64, 32, 4)
    return ExtendConfig(64, 64, 4 if head_dim <= 64 else 8)


# an unused program's block: past any request's last (m_block * BLOCK_M stays within int32)
UNUSED_BLOCK = 1 << 20


class ExtendBlocks(NamedTuple):
    """The program → (request, block of its new tokens) table of a launch: requests in batch
    order, each its ceil(extend / block_m) blocks; programs past them take UNUSED_BLOCK."""
    request: torch.Tensor  # [programs] int64: batch index
    m_block: torch.Tensor  # [programs] int64


def extend_blocks(extend_seq_lens: torch.Tensor, num_tokens: int, block_m: int) -> ExtendBlocks:
    """The table for any batch of at most `num_tokens` new tokens over extend_seq_lens' requests
    (zero-length ones included): cdiv(num_tokens, block_m) + requests programs cover every
    block (each request wastes less than one). Built on the device with fixed shapes, no host
    sync: a CUDA graph captures it."""
    batch = extend_seq_lens.shape[0]
    blocks = (extend_seq_lens + (block_m - 1)) // block_m
    ends = torch.cumsum(blocks, 0)
    program = torch.arange(triton.cdiv(num_tokens, block_m) + batch, device=extend_seq_lens.device)
    request = torch.searchsorted(ends, program, right=True)
    unused = request >= batch
    request = request.clamp_(max=batch - 1)
    m_block = program - (ends[request] - blocks[request])
    return ExtendBlocks(request, m_block.masked_fill_(unused, UNUSED_BLOCK))


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                     extend_prefix_lens: torch.Tensor, max_extend_len: int, sm_scale: float,
                     out: torch.Tensor | None = None,
                     config: Optional[ExtendConfig] = None,
                     blocks: Optional[ExtendBlocks] = None) -> torch.Tensor:
    """q [num_tokens, heads, head_dim] (the new tokens, request after request) →
    [num_tokens, heads, head_dim] in q's dtype. `max_extend_len` (a host int) sizes the grid,
    or `blocks` (`extend_blocks` for this config's block_m) lists the programs.
    `config`: the launch (default `extend_config`)."""
    group = check_kv(q, k_buffer, v_buffer)
    num_tokens, heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    batch = req_pool_indices.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    cfg = config or extend_config(head_dim, q.dtype, group)
    if cfg.packed and triton.next_power_of_2(group) * cfg.block_m < 16:
        raise ValueError(f"packed extend config {cfg}: {group} query heads a KV head x "
                         f"{cfg.block_m} tokens is under the 16 rows tl.dot takes")
    head_programs = heads // group if cfg.packed else heads
    if blocks is None:
        grid = (batch, head_programs, triton.cdiv(max_extend_len, cfg.block_m))
        table = (extend_seq_lens, extend_seq_lens)  # not read
    else:
        grid, table = (blocks.request.shape[0], head_programs, 1), blocks
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, extend_start_loc,
        extend_seq_lens, extend_prefix_lens, *table, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_dmodel(head_dim), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, PRECISION=dot_precision(q.dtype), PACKED=bool(cfg.packed),
        GROUP_PAD=triton.next_power_of_2(group), BLOCK_TABLE=blocks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
