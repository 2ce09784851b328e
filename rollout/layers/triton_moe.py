"""A decode step's sparse MLP in three Triton kernels (CUDA; the CPU interpreter in specs).

At decode sizes the sorted-rows form of `moe.moe_experts` is launch-bound: routing, sorting and
scattering are a dozen small kernels a layer, and the grouped GEMM, tiled for large groups, runs
a one-row group at 40% of the bandwidth (H200, Qwen3-30B-A3B shape, docs/BENCHMARKS.md). Here:

  * `_route_kernel`: a token's router softmax (fp32), top-k by repeated argmax (the lowest
    expert among equal probabilities) and the renormalisation, as `SparseMoE.route` computes
    them;
  * `_gate_up_kernel`: one program per (token, choice) pair and block of expert rows: that
    expert's gate and up rows against the token, then silu(gate)·up with torch's roundings;
  * `_down_kernel`: one program per token and block of output rows: each chosen expert's down
    rows against its activation, rounded as a GEMM output, weighted and summed in fp32.

No sort: a pair reads its expert's rows itself, so an expert two tokens chose is read twice,
which is why this form serves only up to `MAX_TOKENS` tokens. From there to `MAX_BLOCK_TOKENS`
(decode batches) `experts_blocked` sorts the (token, choice) pairs by expert on the device, pads
each expert's run to whole blocks and runs tiled gate/up + SiLU and down over blocks of one
expert's rows, so an expert is read once a block; larger steps (prefill) keep the grouped GEMMs.
No host sync, fixed grids: CUDA graphs capture both."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from rollout.layers.moe import group_by_expert

# Tokens a step may have for this form (ROLLOUT_MOE_DECODE_TOKENS; 0: never). H200, Qwen3-30B-A3B
# shape at 12 layers, engine tok/s, grouped GEMMs → these kernels: 1 token 579 → 1,002, 4 1,470 →
# 2,562, 8 2,259 → 3,515, 16 3,511 → 4,503, 32 5,555 → 5,387 (moe37c / moe37d in BENCHMARKS.md).
MAX_TOKENS = int(os.environ.get("ROLLOUT_MOE_DECODE_TOKENS", "16"))
# (gate/up rows a program, its K chunk, down rows a program, its K chunk, warps): the best of
# six configs at 1–4 tokens; 2 warps gained 3–7% at 8–16 tokens and lost 2% at one.
CONFIG = tuple(int(v) for v in os.environ.get("ROLLOUT_MOE_DECODE_CONFIG",
                                              "8,512,4,256,4").split(","))


def applies(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """The engine's CUDA steps of at most MAX_TOKENS tokens (the specs call the kernels
    themselves under the CPU interpreter)."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_TOKENS and gate_up.is_contiguous()


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype,
          record: Optional[tuple[torch.Tensor, torch.Tensor]] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in `dtype`, expert ids [T, top_k] int32) from router logits [T, E].
    `record` (a RoutingPool layer's ids [slots, top_k] int16, the tokens' KV slots [T]): the ids
    are also written there, by the same kernel (routing replay without a launch of its own)."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if record is not None:
        table, loc = record
        if (table.dim() != 2 or table.shape[1] != top_k or not table.is_contiguous()
                or loc.shape != (tokens,)):
            raise ValueError(f"routing record {tuple(table.shape)} / slots {tuple(loc.shape)} "
                             f"do not fit {tokens} tokens of top {top_k}")
    else:
        table, loc = ids, ids
    _route_kernel[(tokens,)](logits, weights, ids, table, loc, table.shape[0], experts,
                             BLOCK_E=triton.next_power_of_2(experts), TOP_K=top_k,
                             BLOCK_TOP=triton.next_power_of_2(top_k), RENORM=renormalize,
                             RECORD=record is not None)
    return weights, ids


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """`moe.moe_experts` for few tokens: float32 [T, H]."""
    tokens, hidden = x.shape
    top_k, width = ids.shape[1], gate_up.shape[1] // 2
    bn_a, bk_a, bn_b, bk_b, warps = CONFIG
    act = torch.empty(tokens * top_k, width, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(width, bn_a))](
        x, ids, gate_up, act, hidden, width, gate_up.shape[0], TOP_K=top_k, BLOCK_N=bn_a,
        BLOCK_K=bk_a,
        num_warps=warps)
    out = torch.empty(tokens, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(tokens, triton.cdiv(hidden, bn_b))](
        act, ids, weights, down, out, hidden, width, down.shape[0], TOP_K=top_k,
        BLOCK_N=bn_b, BLOCK_K=bk_b,
        num_warps=warps)
    return out


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, record_ptr, loc_ptr, NUM_SLOTS, E,
                  BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr,
                  RENORM: tl.constexpr, RECORD: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    logit = tl.load(logits_ptr + t * E + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, 0))
    p = p / tl.sum(p, 0)
    # NaN (a graph's padded rows before their first write) ranks below every number, so every
    # chosen id is a real expert; invalid lanes are never chosen
    p = tl.where(valid, tl.where(p == p, p, -0.5), -1.0)
    slots = tl.arange(0, BLOCK_TOP)
    top = tl.zeros([BLOCK_TOP], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_TOP], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)
        top = tl.where(slots == j, best, top)
        chosen = tl.where(slots == j, idx, chosen)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        top = top / tl.sum(top, 0)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, top.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, chosen, mask=keep)
    if RECORD:  # slots in range only: a compile-ahead dry forward's inputs are garbage
        slot = tl.load(loc_ptr + t).to(tl.int64) + tl.zeros([BLOCK_TOP], dtype=tl.int64)
        tl.store(record_ptr + slot * TOP_K + slots, chosen.to(tl.int16),
                 mask=keep & (slot >= 0) & (slot < NUM_SLOTS))


@triton.jit
def _real_expert(expert, E):
    """An expert id clamped into [0, E): the routing kernel's ids are always in range, but a
    compile-ahead dry forward skips a kernel variant not compiled yet (a new routing variant)
    and launches the compiled ones after it on its output buffer's garbage."""
    return tl.minimum(tl.maximum(expert.to(tl.int64), 0), E - 1)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, act_ptr, H, W, E, TOP_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < W
    expert = _real_expert(tl.load(ids_ptr + pair), E)
    x_row = x_ptr + (pair // TOP_K) * H
    gate_rows = w_ptr + expert * (2 * W) * H + rows[:, None] * H
    up_rows = gate_rows + W * H
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < H
        x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        tile_ok = row_ok[:, None] & col_ok[None, :]
        g = tl.load(gate_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        u = tl.load(up_rows + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        gate += tl.sum(g * x[None, :], 1)
        up += tl.sum(u * x[None, :], 1)
    dtype = act_ptr.dtype.element_ty
    # torch's roundings: the GEMM's outputs, silu's output, then the product
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = silu * up.to(dtype).to(tl.float32)
    tl.store(act_ptr + pair * W + rows, act.to(dtype), mask=row_ok)


@triton.jit
def _down_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr, H, W, E, TOP_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = _real_expert(tl.load(ids_ptr + pair), E)
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        w_rows = w_ptr + expert * H * W + rows[:, None] * W
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, W, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < W
            a = tl.load(act_ptr + pair * W + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], 1)
        total += acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(out_ptr + token * H + rows, total, mask=row_ok)


# ---- batches past MAX_TOKENS: the routed rows sorted by expert, a block of rows one expert's ----

# Tokens a step may have for the sorted-blocks form (ROLLOUT_MOE_BLOCK_TOKENS; 0: never; the
# largest decode graph's batch), and its config (rows a block, gate/up N tile, K chunk, down N
# tile, K chunk, warps, stages). H200, Qwen3-30B-A3B shape at 12 layers, engine tok/s, grouped
# GEMMs -> sorted blocks: 32 tokens 5,587 -> 7,587, 64 9,577 -> 12,731, 128 16,729 -> 21,489 (the
# best of three configs; moe38 in docs/BENCHMARKS.md).
MAX_BLOCK_TOKENS = int(os.environ.get("ROLLOUT_MOE_BLOCK_TOKENS", "256"))
BLOCK_CONFIG = tuple(int(v) for v in os.environ.get("ROLLOUT_MOE_BLOCK_CONFIG",
                                                    "16,64,128,64,128,4,4").split(","))


def blocks_apply(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """CUDA steps of at most MAX_BLOCK_TOKENS tokens in 16-bit dtypes (tl.dot would take fp32
    as TF32)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_BLOCK_TOKENS
            and x.dtype in (torch.bfloat16, torch.float16) and gate_up.is_contiguous())


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [blocks · block_m]: the (token, choice) pairs grouped by expert, each expert's run
    padded to whole blocks with the sentinel T·top_k; expert of each block, num_experts past the
    last). Fixed sizes, device ops only: no host sync."""
    # in range whatever the ids hold: a compile-ahead dry forward may skip the routing kernel
    # (a variant not compiled yet), so its output is unwritten while these torch ops still run
    flat = ids.reshape(-1).long().clamp(0, num_experts - 1)
    pairs = flat.numel()
    order, counts = group_by_expert(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    padded_end = torch.cumsum(padded, 0)
    expert_sorted = flat[order]
    slot = (padded_end - padded)[expert_sorted] + torch.arange(pairs, device=ids.device) \
        - start[expert_sorted]
    blocks = triton.cdiv(pairs, block_m) + num_experts
    rows = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=ids.device)
    rows.scatter_(0, slot, order.to(torch.int32))
    first_rows = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, first_rows, right=True).to(torch.int32)
    return rows, block_expert


def experts_blocked(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`moe.moe_experts` as two tiled GEMM kernels over blocks of one expert's rows: float32
    [T, H]."""
    tokens, hidden = x.shape
    num_experts, top_k, width = gate_up.shape[0], ids.shape[1], gate_up.shape[1] // 2
    bm, bn_a, bk_a, bn_b, bk_b, warps, stages = BLOCK_CONFIG
    rows, block_expert = align_blocks(ids, num_experts, bm)
    blocks = block_expert.numel()
    pairs = tokens * top_k
    act = torch.empty(pairs, width, dtype=x.dtype, device=x.device)
    _blocked_gate_up_kernel[(blocks, triton.cdiv(width, bn_a))](
        x, rows, block_expert, gate_up, act, hidden, width, pairs, num_experts, TOP_K=top_k,
        BLOCK_M=bm, BLOCK_N=bn_a, BLOCK_K=bk_a, num_warps=warps, num_stages=stages)
    per_pair = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _blocked_down_kernel[(blocks, triton.cdiv(hidden, bn_b))](
        act, rows, block_expert, weights, down, per_pair, hidden, width, pairs, num_experts,
        BLOCK_M=bm, BLOCK_N=bn_b, BLOCK_K=bk_b, num_warps=warps, num_stages=stages)
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)


@triton.jit
def _block(block_expert_ptr, rows_ptr, PAIRS, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (expert — E past the last block —, which of its block's rows hold a pair,
    the pairs with the padding rows' sentinel as 0, its output columns, which are < N)."""
    block = tl.program_id(0)
    pair = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < PAIRS
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (tl.load(block_expert_ptr + block).to(tl.int64), pair_ok,
            tl.where(pair_ok, pair, 0).to(tl.int64), n, n < N)


@triton.jit
def _blocked_gate_up_kernel(x_ptr, rows_ptr, block_expert_ptr, w_ptr, act_ptr, H, W, PAIRS, E,
                            TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    expert, pair_ok, pair, n, n_ok = _block(block_expert_ptr, rows_ptr, PAIRS, W, BLOCK_M,
                                            BLOCK_N)
    if expert >= E:
        return
    token = pair // TOP_K
    gate_rows = w_ptr + expert * (2 * W) * H + n[None, :] * H
    up_rows = gate_rows + W * H
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(x_ptr + token[:, None] * H + k[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & n_ok[None, :]
        gate = tl.dot(a, tl.load(gate_rows + k[:, None], mask=b_ok, other=0.0), gate)
        up = tl.dot(a, tl.load(up_rows + k[:, None], mask=b_ok, other=0.0), up)
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(act_ptr + pair[:, None] * W + n[None, :], act,
             mask=pair_ok[:, None] & n_ok[None, :])


@triton.jit
def _blocked_down_kernel(act_ptr, rows_ptr, block_expert_ptr, weights_ptr, w_ptr, out_ptr, H, W,
                         PAIRS, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    expert, pair_ok, safe_pair, n, n_ok = _block(block_expert_ptr, rows_ptr, PAIRS, H, BLOCK_M,
                                                 BLOCK_N)
    if expert >= E:
        return
    w_rows = w_ptr + expert * H * W + n[None, :] * W
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, W, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < W
        a = tl.load(act_ptr + safe_pair[:, None] * W + k[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                                other=0.0), acc)
    weight = tl.load(weights_ptr + safe_pair, mask=pair_ok, other=0.0).to(tl.float32)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + safe_pair[:, None] * H + n[None, :], y,
             mask=pair_ok[:, None] & n_ok[None, :])
