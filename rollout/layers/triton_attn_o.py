"""The o projection of a one-token decode that merges the split-KV attention's partial results
itself: the attention's merge kernel is not launched.

Why: at batch 1 the decode attention splits each head's keys 8 ways (to fill the GPU), and a
merge kernel turns the partials into the output that o reads. Under PDL a step is a chain of
short kernels; the merge kernel's place in it cost 0.9 µs a layer (ablated, sixteenth session).
Here o is split along K by attention head: program (n block, head h) merges head h's splits —
4 KB of fp32 partials, read from L2 — into the 128 inputs its weight columns need, then sums
them against its [BLOCK_N, head_dim] weight tile, loaded before its PDL wait. Its fp32 partials
[heads, 1, N] go to the post-attention add + RMSNorm as a SplitSum (summed in head order there).

Rounding: the merge is the attention merge kernel's (`merge_splits`, split order), rounded to
the weight's dtype as the attention's output is, so o's inputs are bit for bit the unfused
path's; o's sums run in another order than the one-row GEMV's (per head, then across heads in
the norm kernel): not bitwise equal to it, within fp32 rounding of the same products.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rollout.attention.base import DecodePartials
from rollout.attention.triton_kernels.common import block_dmodel
from rollout.attention.triton_kernels.decode import merge_splits
from rollout.layers.split_sum import SplitSum
from rollout.triton_pdl import launch_options, pdl_wait


class MergeOConfig(NamedTuple):
    block_n: int = 16  # o's output columns a program (its weight tile: block_n x head_dim)
    num_warps: int = 2


def config_from_env() -> MergeOConfig | None:
    """ROLLOUT_ATTN_O_MERGE: "1" (default) the default config, "0" off (the merge kernel and
    the plain GEMV), "BLOCK_N,WARPS" another config."""
    spec = os.environ.get("ROLLOUT_ATTN_O_MERGE", "1").strip()
    if spec == "0":
        return None
    if spec == "1":
        return MergeOConfig()
    try:
        block_n, warps = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"ROLLOUT_ATTN_O_MERGE={spec!r}: want 0, 1 or BLOCK_N,WARPS") from None
    if block_n < 1 or block_n & (block_n - 1) or warps < 1:
        raise ValueError(f"ROLLOUT_ATTN_O_MERGE={spec!r}: BLOCK_N a power of two, WARPS >= 1")
    return MergeOConfig(block_n, warps)


ENV_CONFIG = config_from_env()


@triton.jit
def _merge_o_kernel(PartO, PartLse, SeqLens, W, P, N, stride_ph, stride_ps, stride_lh,
                    stride_wn, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    head = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    n_mask = offs_n < N
    # Before the PDL wait: the weights (no kernel writes them) and the step's input seq_len
    # (written before the step's first kernel) stream in while the attention runs
    w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + head * HEAD_DIM + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    seq_len = tl.load(SeqLens).to(tl.int32)
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    acc, l_i = merge_splits(PartO, PartLse, head * stride_ph, head * stride_lh, stride_ps,
                            seq_len, offs_d, d_mask, BLOCK_D, NUM_SPLITS)
    x = (acc / l_i).to(W.dtype.element_ty).to(tl.float32)  # the attention output's rounding
    out = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(P + head * N + offs_n, out, mask=n_mask)


def merge_o(attn: DecodePartials, weight: torch.Tensor,
            config: MergeOConfig = MergeOConfig()) -> SplitSum:
    """o(merged attention) for one query row: `attn` from a backend's `decode_partials` (part_o
    [1, heads, splits, head_dim] and part_lse [1, heads, splits] fp32; splits past seq_lens[0]'s
    end are ignored), weight [N, heads * head_dim] → the [1, N] output as per-head fp32 partials
    (a SplitSum whose `out` has the weight's dtype)."""
    part_o, part_lse, seq_lens = attn
    batch, heads, splits, head_dim = part_o.shape
    n, k = weight.shape
    if batch != 1 or part_lse.shape != (1, heads, splits) or k != heads * head_dim:
        raise ValueError(f"partials {tuple(part_o.shape)} / {tuple(part_lse.shape)} do not fit "
                         f"one row of o with weight {tuple(weight.shape)}")
    if part_o.stride(3) != 1 or weight.stride(1) != 1 or part_o.dtype != torch.float32:
        raise ValueError("fp32 partials and the weight must be contiguous in their last dim")
    partials = torch.empty(heads, 1, n, dtype=torch.float32, device=weight.device)
    out = torch.empty(1, n, dtype=weight.dtype, device=weight.device)
    _merge_o_kernel[(triton.cdiv(n, config.block_n), heads)](
        part_o, part_lse, seq_lens, weight, partials, n, part_o.stride(1), part_o.stride(2),
        part_lse.stride(1), weight.stride(0), HEAD_DIM=head_dim, BLOCK_D=block_dmodel(head_dim),
        BLOCK_N=config.block_n, NUM_SPLITS=splits, num_warps=config.num_warps,
        **launch_options(preloads_weights=True))
    return SplitSum(partials, out)
