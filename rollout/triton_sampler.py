"""The sampler's common case on a GPU in three Triton kernels: no top-k/top-p/min-p filter and no
top-logprobs (RL rollouts at a temperature; greedy rows too).

The torch path (`sampler.sample`) is ~20 small kernels a step: softmax, a padded copy, float64
block sums, cumsums, searchsorteds, gathers, an argmax, where... (≈0.43 ms a step at batch 128 ×
152k vocabulary on an H200, ≈0.1 ms at batch 1, plus a host launch each). Here:
  1. `_chunk_max`: per chunk of CHUNK tokens of each row, the max of logits/T and its first index;
  2. `_chunk_sum`: the row's max m from (1), then per chunk the fp32 sum of exp(logits/T - m);
  3. `_pick`: per row, float64 prefix sums of the chunk sums pick the chunk where u * total
     falls, a float64 prefix sum inside that chunk (of the same fp32 terms as (2)) picks the
     token; greedy rows take the argmax. logprob = logits/T - m - log(total).
The same distribution as the torch path — inverse CDF in vocabulary order at the row's uniform
from (seed, position), sums in float64 — up to the order of the additions and expf's last bit,
so a draw can differ where u * total lies within rounding of a token boundary. Rows are
independent: a request draws the same token whatever else is in the batch. No host syncs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.triton_pdl import launch_options, pdl_wait

CHUNK = 2048  # tokens per program of kernels 1 and 2


@triton.jit
def _chunk_max(Logits, stride_row, Temps, CMax, CIdx, V, C, CHUNK: tl.constexpr,
               USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row.to(tl.int64) * stride_row + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    x = x / tl.load(Temps + row)
    m = tl.max(x, axis=0)
    first = tl.min(tl.where(x == m, offs, V), axis=0)
    tl.store(CMax + row * C + c, m)
    tl.store(CIdx + row * C + c, first)


@triton.jit
def _row_max(CMax, row, C, BLOCK_C: tl.constexpr):
    cs = tl.arange(0, BLOCK_C)
    return tl.max(tl.load(CMax + row * C + cs, mask=cs < C, other=float("-inf")), axis=0)


@triton.jit
def _chunk_sum(Logits, stride_row, Temps, CMax, CSum, V, C, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
               USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    row, c = tl.program_id(0), tl.program_id(1)
    m = _row_max(CMax, row, C, BLOCK_C)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row.to(tl.int64) * stride_row + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    p = tl.exp(x / tl.load(Temps + row) - m)  # exp(-inf) = 0 on the tail
    tl.store(CSum + row * C + c, tl.sum(p, axis=0))


@triton.jit
def _pick(Logits, stride_row, Temps, Greedy, U, CMax, CIdx, CSum, Tokens, Logprobs, Packed, B, V, C,
          CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
          USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    row = tl.program_id(0)
    t = tl.load(Temps + row)
    cs = tl.arange(0, BLOCK_C)
    cmax = tl.load(CMax + row * C + cs, mask=cs < C, other=float("-inf"))
    m = tl.max(cmax, axis=0)
    # first index of the row's max: the first chunk holding m, then its first index
    argmax = tl.min(tl.where(cmax == m, tl.load(CIdx + row * C + cs, mask=cs < C, other=V), V), axis=0)
    mass = tl.load(CSum + row * C + cs, mask=cs < C, other=0.0).to(tl.float64)
    prefix = tl.cumsum(mass, axis=0)
    total = tl.max(prefix, axis=0)  # prefix sums of non-negative terms: the last is the largest
    target = tl.load(U + row) * total
    chunk = tl.minimum(tl.min(tl.where(prefix > target, cs, BLOCK_C), axis=0), C - 1)
    before = tl.sum(tl.where(cs == chunk, prefix - mass, 0.0), axis=0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row.to(tl.int64) * stride_row + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    p = tl.exp(x / t - m)
    cdf = before + tl.cumsum(p.to(tl.float64), axis=0)
    hit = tl.min(tl.where((cdf > target) & (p > 0), offs, V), axis=0)
    # u * total rounded up to total (u within 2^-53 of 1): the likeliest token, as the torch path
    token = tl.where(hit < V, hit, argmax)
    token = tl.where(tl.load(Greedy + row) != 0, argmax, token)
    x_tok = tl.load(Logits + row.to(tl.int64) * stride_row + token).to(tl.float32) / t
    logprob = (x_tok - m) - tl.log(total.to(tl.float32))
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, logprob)
    # [2, B] float64 (token ids are exact in float64): the step's one copy to the host
    tl.store(Packed + row, token.to(tl.float64))
    tl.store(Packed + B + row, logprob.to(tl.float64))


def sample_unfiltered(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] float32, bf16 or fp16 (rows contiguous; read as exactly those values in
    float32), temperatures [B] float32 (1.0 on greedy rows),
    greedy [B] bool, uniforms [B] float64 → (tokens [B] int64, logprobs [B] float32, the two
    stacked as [2, B] float64 for the copy to the host)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    block_c = triton.next_power_of_2(chunks)
    dev = logits.device
    cmax = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    cidx = torch.empty(rows, chunks, dtype=torch.int32, device=dev)
    csum = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    packed = torch.empty(2, rows, dtype=torch.float64, device=dev)
    stride = logits.stride(0)
    _chunk_max[(rows, chunks)](logits, stride, temperatures, cmax, cidx, vocab, chunks, CHUNK=CHUNK,
                               num_warps=8, **launch_options())
    _chunk_sum[(rows, chunks)](logits, stride, temperatures, cmax, csum, vocab, chunks, CHUNK=CHUNK,
                               BLOCK_C=block_c, num_warps=8, **launch_options())
    _pick[(rows,)](logits, stride, temperatures, greedy, uniforms, cmax, cidx, csum, tokens, logprobs,
                   packed, rows, vocab, chunks, CHUNK=CHUNK, BLOCK_C=block_c, num_warps=8,
                   **launch_options())
    return tokens, logprobs, packed


__all__ = ["sample_unfiltered", "CHUNK"]
