"""A decode graph's inputs in one launch: the static index table filled from the step's packed
indices (padded rows past the batch), the input ids taken from the tokens the previous step
sampled on the device, and the step's new KV slots recorded in req_to_token.

Before this kernel those were three stream ops a step ahead of the graph — the input-id copy,
the req_to_token write kernel and the table copy — each with its launch gap (≈1–1.5 µs on an
H200) on the critical path of a batch-1 step. ROLLOUT_GRAPH_INPUT_KERNEL=0: the three ops."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.triton_pdl import launch_options, pdl_wait

FUSED_GRAPH_INPUTS = os.environ.get("ROLLOUT_GRAPH_INPUT_KERNEL", "1") != "0"

BLOCK = 256  # rows a program: one program for any captured batch up to 256


# the batch's sizes (and the index rows' addresses, views of a step's packed array) are not
# specialized on: one compiled variant serves every batch, so the engine compiles it ahead
# (cuda_graph_runner) instead of at a first `generate` of each new batch-size class
@triton.jit(do_not_specialize=["stride_src", "stride_table", "stride_pad", "bs", "graph_bs"],
            do_not_specialize_on_alignment=["Src", "Tokens"])
def _fill_kernel(Src, stride_src, Table, stride_table, Pad, stride_pad, Tokens, ReqToToken,
                 stride_r2t, bs, graph_bs, NUM_FIELDS: tl.constexpr, HAS_TOKENS: tl.constexpr,
                 BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # the previous step's graph reads the table and req_to_token, its sampler writes Tokens
    pdl_wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = offs < bs
    padded = (offs >= bs) & (offs < graph_bs)
    for f in tl.static_range(NUM_FIELDS):
        if f == 0 and HAS_TOKENS:
            v = tl.load(Tokens + offs, mask=real, other=0)
        else:
            v = tl.load(Src + f * stride_src + offs, mask=real, other=0)
        v = tl.where(real, v, tl.load(Pad + f * stride_pad + offs, mask=padded, other=0))
        tl.store(Table + f * stride_table + offs, v, mask=real | padded)
    # the table's rows are cuda_graph_runner.PAD_FIELDS: 0 input ids, 1 positions, 2 KV slots,
    # 3 token rows (the last three say where each token's KV goes)
    row = tl.load(Src + 3 * stride_src + offs, mask=real, other=0)
    pos = tl.load(Src + 1 * stride_src + offs, mask=real, other=0)
    slot = tl.load(Src + 2 * stride_src + offs, mask=real, other=0)
    tl.store(ReqToToken + row * stride_r2t + pos, slot.to(tl.int32), mask=real)


def fill_decode_inputs(src: torch.Tensor, table: torch.Tensor, pad: torch.Tensor,
                       tokens: Optional[torch.Tensor], req_to_token: torch.Tensor,
                       graph_bs: int) -> None:
    """src: [F, bs] int64, the step's index rows in the table's order (input ids, positions,
    KV slots, token rows, ...; unit stride along a row); table, pad: [F, max_bs] int64 (the
    graph's static rows, their idle values). table[:, :bs] = src (row 0 from `tokens` when
    given), table[:, bs:graph_bs] = pad, req_to_token[src[3], src[1]] = int32(src[2])."""
    fields, bs = src.shape
    if table.shape[0] != fields or pad.shape != table.shape or not bs <= graph_bs <= table.shape[1]:
        raise ValueError(f"src {tuple(src.shape)}, table {tuple(table.shape)}, pad "
                         f"{tuple(pad.shape)}, graph_bs {graph_bs} do not fit")
    if src.stride(1) != 1 or table.stride(1) != 1 or pad.stride(1) != 1:
        raise ValueError("src, table and pad rows must have unit stride")
    if tokens is not None and (tokens.shape != (bs,) or tokens.stride(0) != 1):
        raise ValueError(f"tokens {tuple(tokens.shape)} is not one contiguous id per row ({bs})")
    _fill_kernel[(triton.cdiv(graph_bs, BLOCK),)](
        src, src.stride(0), table, table.stride(0), pad, pad.stride(0),
        tokens if tokens is not None else src, req_to_token, req_to_token.stride(0), bs, graph_bs,
        NUM_FIELDS=fields, HAS_TOKENS=tokens is not None, BLOCK=BLOCK, num_warps=4,
        **launch_options())


# ---- a decode step graph's inputs (`step_graphs`) ---------------------------------------------
# The step graph's static source table: the first six rows as the table's (input ids: -1 takes
# the row's token from the previous step's device tokens), then the sampler's rows, and the
# number of real rows (the rest pad the graph's batch) in the last row's first column: a
# captured kernel reads its batch size, it cannot be passed.
STEP_UNIFORMS, STEP_TEMPERATURES, STEP_GREEDY, STEP_BS = 6, 7, 8, 9
STEP_ROWS = 10
TAKE_PREVIOUS = -1  # an input id the previous step is still sampling


@triton.jit(do_not_specialize=["stride_src", "stride_table", "stride_r2t", "graph_bs"])
def _fill_step_kernel(Src, stride_src, Table, stride_table, Tokens, ReqToToken, stride_r2t,
                      graph_bs, NUM_FIELDS: tl.constexpr, BS_ROW: tl.constexpr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # the previous step's graph reads the table and req_to_token, its sampler writes Tokens
    pdl_wait(USE_PDL)
    bs = tl.load(Src + BS_ROW * stride_src)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_graph = offs < graph_bs
    real = offs < bs
    for f in tl.static_range(NUM_FIELDS):
        v = tl.load(Src + f * stride_src + offs, mask=in_graph, other=0)
        if f == 0:  # loaded whatever v says: one latency of memory, not two in a row
            previous = tl.load(Tokens + offs, mask=in_graph, other=0)
            v = tl.where(v < 0, previous, v)
        tl.store(Table + f * stride_table + offs, v, mask=in_graph)
    row = tl.load(Src + 3 * stride_src + offs, mask=real, other=0)
    pos = tl.load(Src + 1 * stride_src + offs, mask=real, other=0)
    slot = tl.load(Src + 2 * stride_src + offs, mask=real, other=0)
    tl.store(ReqToToken + row * stride_r2t + pos, slot.to(tl.int32), mask=real)


def fill_step_inputs(src: torch.Tensor, table: torch.Tensor, tokens: torch.Tensor,
                     req_to_token: torch.Tensor, graph_bs: int) -> None:
    """src: [STEP_ROWS, >= graph_bs] int64, a step graph's source table, its columns past the
    real rows holding the padded-row values; table: [F, >= graph_bs] int64 (F index rows);
    tokens: the previous step's device tokens, one per row. table[:, :graph_bs] =
    src[:F, :graph_bs], an input id of TAKE_PREVIOUS replaced by the row's token, and for the
    real rows (src[STEP_BS, 0] of them) req_to_token[src[3], src[1]] = int32(src[2])."""
    fields = table.shape[0]
    if (src.shape[0] != STEP_ROWS or fields > STEP_UNIFORMS or not graph_bs <= src.shape[1]
            or not graph_bs <= table.shape[1] or tokens.numel() < graph_bs):
        raise ValueError(f"src {tuple(src.shape)}, table {tuple(table.shape)}, tokens "
                         f"{tuple(tokens.shape)}, graph_bs {graph_bs} do not fit")
    if src.stride(1) != 1 or table.stride(1) != 1 or tokens.stride(0) != 1:
        raise ValueError("src and table rows and the tokens must have unit stride")
    _fill_step_kernel[(triton.cdiv(graph_bs, BLOCK),)](
        src, src.stride(0), table, table.stride(0), tokens, req_to_token, req_to_token.stride(0),
        graph_bs, NUM_FIELDS=fields, BS_ROW=STEP_BS, BLOCK=BLOCK, num_warps=4,
        **launch_options())
