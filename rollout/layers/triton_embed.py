"""A forward's first kernel on a GPU: the token embeddings and the rotary cos/sin rows of the
step's positions, two gathers in one launch.

They were two torch index_selects at the head of every decode graph, launched without PDL, so
each cost the step its launch gap and its run, one after the other, before the first layer's
norm could start. Here one Triton kernel, a program per token, copies the token's embedding row
and its position's row of the rotary half table (`RotaryEmbedding.half_table`): the same values
bit for bit, and the norm after it launches early (PDL). ROLLOUT_FUSED_EMBED_ROPE=0: the two
index_selects."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rollout.layers.rotary import split_cos_sin
from rollout.triton_pdl import launch_options, pdl_wait

FUSED_EMBED_ROPE = os.environ.get("ROLLOUT_FUSED_EMBED_ROPE", "1") != "0"


# ids and positions are views into a step's packed indices, the positions at an offset that goes
# with its token count: not specialized on alignment (one variant for every batch; scalar loads)
@triton.jit(do_not_specialize_on_alignment=["Ids", "Positions"])
def _embed_rope_kernel(Ids, Positions, Weight, stride_w, Out, stride_o, Table, stride_t, CosSin,
                       stride_cs, HIDDEN: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # the ids and positions are an earlier op's output
    t = tl.program_id(0).to(tl.int64)
    token = tl.load(Ids + t).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    row = tl.load(Weight + token * stride_w + h, mask=h < HIDDEN)
    cs = tl.load(Table + pos * stride_t + r, mask=r < ROPE)
    tl.store(Out + t * stride_o + h, row, mask=h < HIDDEN)
    tl.store(CosSin + t * stride_cs + r, cs, mask=r < ROPE)


def embed_and_rope(input_ids: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor,
                   half_table: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(weight[input_ids], (cos, sin)) with (cos, sin) = `split_cos_sin(half_table[positions])`:
    input_ids, positions [T] (in range: the scheduler's), weight [V, hidden] and half_table
    [P, 2, head_dim / 2] with contiguous rows."""
    t = input_ids.shape[0]
    if (positions.shape != (t,) or input_ids.stride(0) != 1 or positions.stride(0) != 1
            or weight.stride(1) != 1 or not half_table.is_contiguous()):
        raise ValueError(f"ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)}: "
                         "want one position per id, each contiguous, rows of weight and table too")
    hidden, rope = weight.shape[1], half_table.shape[1] * half_table.shape[2]
    out = torch.empty(t, hidden, dtype=weight.dtype, device=weight.device)
    both = torch.empty(t, *half_table.shape[1:], dtype=half_table.dtype, device=weight.device)
    if t:
        _embed_rope_kernel[(t,)](
            input_ids, positions, weight, weight.stride(0), out, out.stride(0), half_table,
            half_table.stride(0), both, both.stride(0), HIDDEN=hidden, ROPE=rope,
            BLOCK_H=triton.next_power_of_2(hidden), BLOCK_R=triton.next_power_of_2(rope),
            num_warps=4 if hidden >= 1024 else 1, **launch_options())
    return out, split_cos_sin(both)
