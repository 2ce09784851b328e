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
which is why this form serves only up to `MAX_TOKENS` tokens (the larger batches keep the
grouped GEMMs). No host sync, fixed grids: CUDA graphs capture it."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in `dtype`, expert ids [T, top_k] int32) from router logits [T, E]."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    _route_kernel[(tokens,)](logits, weights, ids, experts, BLOCK_E=triton.next_power_of_2(experts),
                             TOP_K=top_k, BLOCK_TOP=triton.next_power_of_2(top_k),
                             RENORM=renormalize)
    return weights, ids


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """`moe.moe_experts` for few tokens: float32 [T, H]."""
    tokens, hidden = x.shape
    top_k, width = ids.shape[1], gate_up.shape[1] // 2
    bn_a, bk_a, bn_b, bk_b, warps = CONFIG
    act = torch.empty(tokens * top_k, width, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(width, bn_a))](
        x, ids, gate_up, act, hidden, width, TOP_K=top_k, BLOCK_N=bn_a, BLOCK_K=bk_a,
        num_warps=warps)
    out = torch.empty(tokens, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(tokens, triton.cdiv(hidden, bn_b))](
        act, ids, weights, down, out, hidden, width, TOP_K=top_k, BLOCK_N=bn_b, BLOCK_K=bk_b,
        num_warps=warps)
    return out


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, BLOCK_E: tl.constexpr,
                  TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, RENORM: tl.constexpr):
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


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, act_ptr, H, W, TOP_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < W
    expert = tl.load(ids_ptr + pair).to(tl.int64)
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
def _down_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr, H, W, TOP_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
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

