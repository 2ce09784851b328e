"""The sampler's common case on a GPU in two Triton kernels: no top-k/top-p/min-p filter and no
top-logprobs (RL rollouts at a temperature; greedy rows too).

The torch path (`sampler.sample`) is ~20 small kernels a step: softmax, a padded copy, float64
block sums, cumsums, searchsorteds, gathers, an argmax, where... (≈0.43 ms a step at batch 128 ×
152k vocabulary on an H200, ≈0.1 ms at batch 1, plus a host launch each). Here, x = logits / T:
  1. `_chunk_stats`: per chunk c of CHUNK tokens of each row, its max m_c and the fp32 sum s_c
     of exp(x - m_c). Each chunk's sum is taken in its own max frame, so the row's max is not
     needed first and the logits are read once (39 MB at batch 128 in bf16).
  2. `_pick`: per row, m = max m_c; in float64, w_c = s_c · exp(m_c - m) and total = Σ w_c;
     the prefix sums of w pick the chunk where u · total falls, then in that chunk the same
     fp32 terms exp(x - m_c), their float64 prefix sums times exp(m_c - m) added to the mass
     before it, pick the first token whose sum exceeds u · total (and whose term is not 0);
     greedy rows take the argmax (the first index of m in the first chunk holding it, loaded
     beside the chosen chunk), and so does u · total rounded up to total. logprob = x_token - m
     - log(total). Every load but those two chunks' is issued at once: two latencies of memory
     a row (seven, one after another, before the sixteenth session).
At batch 128 the statistics kernel is bound by its instructions (19.4 M logits a step), so it
does the least per logit: the max and the sum only (the argmax index is `_pick`'s, from one
chunk), and compiled, exp is `ex2.approx.ftz` (`_exp`: the same bits as tl.exp's `ex2.approx`
but for results below 2^-126, which flush to 0). Twentieth session, compiled for sm_90 by
Triton 3.6 at the batch-128 launch: 17.5 → 10.4 SASS instructions a logit (13.4 without the
index alone).
The same distribution as the torch path — inverse CDF in vocabulary order at the row's uniform
from (seed, position), sums in float64 — up to the order of the additions and expf's last bit,
so a draw can differ where u · total lies within rounding of a token boundary (and a token
more than 87 below the max, where torch's fp32 exp(x - m) underflows, can keep its negligible
mass here, through its chunk's float64 exp(m_c - m)). Rows are independent: a request draws the
same token whatever else is in the batch. No host syncs.

Until the sixteenth session the statistics took two reads of the logits (the chunk maxima,
then the sums of exp(x - m) in the row's frame): on an H200, one read took batch 128 from 51,471
to 52,025 tok/s and batch 1 from 889 to 893 (docs/BENCHMARKS.md). `SamplerLaunch` is how the two
kernels are launched (ROLLOUT_SAMPLER_LAUNCH).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rollout.layers.triton_ops import _is_compiled
from rollout.triton_pdl import launch_options, pdl_wait

CHUNK = 2048  # tokens a chunk: the statistics' grain, and what `_pick` scans of a row


class SamplerLaunch(NamedTuple):
    """How the kernels are launched (the same statistics whatever the values, up to the order of
    fp32 additions in a chunk's sum)."""
    chunks_per_program: int = 1  # of `_chunk_stats`: loaded at once, as one [G, CHUNK] tile
    stats_warps: int = 8
    pick_warps: int = 8


# at 64 rows and more, four chunks a statistics program, 4 warps (`benchmarks/gpu_sampler.py`,
# H200, bf16 logits of 151,936, µs a call: 128 rows 24.94 -> 22.56; 32 rows 9.40 -> 9.31; one
# row 4.58 -> 5.34, where one chunk a program stays)
MANY_ROWS, MANY_ROWS_LAUNCH = 64, SamplerLaunch(4, 4, 8)


def launch_for(rows: int) -> SamplerLaunch:
    """The launch for a batch of `rows`: ROLLOUT_SAMPLER_LAUNCH's if set, else the measured one."""
    if ENV_LAUNCH is not None:
        return ENV_LAUNCH
    return MANY_ROWS_LAUNCH if rows >= MANY_ROWS else SamplerLaunch()


def launch_from_env() -> SamplerLaunch | None:
    """ROLLOUT_SAMPLER_LAUNCH="CHUNKS_PER_PROGRAM,STATS_WARPS,PICK_WARPS" (powers of two) for
    every batch: another GPU's measured launch without a code change. None if unset."""
    spec = os.environ.get("ROLLOUT_SAMPLER_LAUNCH")
    if not spec:
        return None
    try:
        launch = SamplerLaunch(*(int(v) for v in spec.split(",")))
    except (ValueError, TypeError):
        launch = None
    if (launch is None or len(spec.split(",")) != 3
            or any(v < 1 or v & (v - 1) or v > 32 for v in launch)):
        raise ValueError(f"ROLLOUT_SAMPLER_LAUNCH={spec!r}: want CHUNKS_PER_PROGRAM,STATS_WARPS,"
                         "PICK_WARPS, powers of two up to 32")
    return launch


ENV_LAUNCH = launch_from_env()


@triton.jit
def _div(x, t, COMPILED: tl.constexpr):
    """x / t rounded as IEEE division rounds it (torch's logits / T) for a row's scalar t.
    Compiled, a plain `x / t` is x · rcp.approx(t), up to 2 ulp of x off (logprobs 1.6e-5 off
    torch's at T = 0.05, logits near 50), and div.rn costs ~15 instructions a logit; instead the
    correctly rounded r = 1/t once, then one Newton step on the fma residual, 3 instructions:
    with q = RN(x·r), fma(fma(-q, t, x), r, q) = RN(x / t) (Markstein; its spec checks it in
    exact arithmetic). ±inf is kept apart (its residual is NaN)."""
    if COMPILED:
        r = tl.math.div_rn(1.0, t)
        q = x * r
        q = tl.fma(tl.fma(-q, t, x), r, q)
        return tl.where(tl.abs(x) == float("inf"), x * r, q)
    return x / t


# UNIT_T of the kernels: every row divides by its T; no row does (the caller knows every T is
# 1: the batch's host-side flag); or each row checks its own T (a captured step, whose graph
# serves every batch of its size: `step_graphs`). x / 1 is x, so all three give the same values.
DIVIDE, UNIT_T_ALL, UNIT_T_PER_ROW = 0, 1, 2


@triton.jit
def _scaled_logits(Logits, stride_row, row, offs, V, t, UNIT_T: tl.constexpr,
                   COMPILED: tl.constexpr):
    """logits / T of `row` at `offs` in float32 (`_div`); -inf past the vocabulary. UNIT_T
    (above): when T is 1 there is no division (at batch 128 the statistics kernel is bound by
    its instructions)."""
    x = tl.load(Logits + row.to(tl.int64) * stride_row + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    if UNIT_T == 1:
        return x
    if UNIT_T == 2:
        y = x
        if t != 1.0:  # one row a program: a uniform branch
            y = _div(x, t, COMPILED)
        return y
    return _div(x, t, COMPILED)


@triton.jit
def _exp(x, COMPILED: tl.constexpr):
    """exp(x) in fp32 as tl.exp computes it (ex2.approx of x · log2(e), the same fp32 product),
    but compiled with `.ftz`: results below 2^-126 are 0, not denormals, which spares the three
    instructions a value of the denormal path (a chunk's terms below 2^-126 against its max's
    1 change no fp32 sum; `_pick` never draws such a token unless u · total is below ~1e-38)."""
    if COMPILED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                         [x * 1.4426950408889634], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.exp(x)


@triton.jit
def _terms(x, m_c, COMPILED: tl.constexpr):
    """exp(x - m_c) in fp32: a chunk's softmax terms in its own max frame, the same values where
    `_chunk_stats` sums them and where `_pick` scans them. A chunk of -inf logits only has
    zeros (not exp(-inf - -inf) = NaN)."""
    return _exp(x - tl.where(m_c == float("-inf"), 0.0, m_c), COMPILED)


@triton.jit
def _chunk_stats(Logits, stride_row, Temps, CMax, CSum, V, C, CHUNK: tl.constexpr,
                 GROUP: tl.constexpr, UNIT_T: tl.constexpr, COMPILED: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """Chunks GROUP·pid .. GROUP·pid + GROUP - 1 of a row, loaded as one [GROUP, CHUNK] tile: a
    program streams GROUP·CHUNK logits (at batch 128, 75 programs a row of 4 KB each would be
    more program than load)."""
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    row = tl.program_id(0)
    cs = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    offs = cs[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    x = _scaled_logits(Logits, stride_row, row, offs, V, tl.load(Temps + row), UNIT_T,
                       COMPILED)
    m_c = tl.max(x, axis=1)
    c_mask = cs < C
    tl.store(CMax + row * C + cs, m_c, mask=c_mask)
    tl.store(CSum + row * C + cs, tl.sum(_terms(x, m_c[:, None], COMPILED), axis=1), mask=c_mask)


@triton.jit(do_not_specialize=["B"])  # one variant for every batch (compiled ahead)
def _pick(Logits, stride_row, Temps, Greedy, U, CMax, CSum, Tokens, Logprobs, Packed, B, V, C,
          CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, UNIT_T: tl.constexpr,
          COMPILED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    row = tl.program_id(0)
    cs = tl.arange(0, BLOCK_C)
    # every load but the chosen chunk's, before the first reduction: their latencies overlap,
    # where one after another (a reduction's barrier between two) they would be most of a row's
    # time at small batches
    t, u, greedy = tl.load(Temps + row), tl.load(U + row), tl.load(Greedy + row)
    cmax = tl.load(CMax + row * C + cs, mask=cs < C, other=float("-inf"))
    csum = tl.load(CSum + row * C + cs, mask=cs < C, other=0.0)
    m = tl.max(cmax, axis=0)
    # the first chunk holding the row's max: its first index of m is the argmax (the load goes
    # out beside the chosen chunk's, no latency of its own)
    max_chunk = tl.min(tl.where(cmax == m, cs, BLOCK_C), axis=0)
    # from each chunk's max frame to the row's in float64, where exp(m_c - m) does not underflow
    # for chunks far below the max (a low temperature)
    scale = tl.exp(cmax.to(tl.float64) - m.to(tl.float64))
    mass = csum.to(tl.float64) * scale
    prefix = tl.cumsum(mass, axis=0)
    total = tl.max(prefix, axis=0)  # prefix sums of non-negative terms: the last is the largest
    target = u * total
    chunk = tl.minimum(tl.min(tl.where(prefix > target, cs, BLOCK_C), axis=0), C - 1)
    chosen = cs == chunk
    before = tl.sum(tl.where(chosen, prefix - mass, 0.0), axis=0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _scaled_logits(Logits, stride_row, row, offs, V, t, UNIT_T, COMPILED)
    max_offs = tl.minimum(max_chunk, C - 1) * CHUNK + tl.arange(0, CHUNK)
    x_max = _scaled_logits(Logits, stride_row, row, max_offs, V, t, UNIT_T, COMPILED)
    argmax = tl.min(tl.where(x_max == m, max_offs, V), axis=0)
    p = _terms(x, tl.max(tl.where(chosen, cmax, float("-inf")), axis=0), COMPILED)
    # the chunk's prefix sums brought to the row's frame as its mass was
    cdf = before + tl.sum(tl.where(chosen, scale, 0.0), axis=0) * tl.cumsum(p.to(tl.float64), axis=0)
    hit = tl.min(tl.where((cdf > target) & (p > 0), offs, V), axis=0)
    # u * total rounded up to total (u within 2^-53 of 1): the likeliest token, as the torch path
    token = tl.where(hit < V, hit, argmax)
    token = tl.where(greedy != 0, argmax, token)
    # x at the argmax is m itself, any other token's is in the chunk just loaded: no read of the
    # logits after that one (another latency of memory)
    x_tok = tl.where(token == argmax, m, tl.max(tl.where(offs == token, x, float("-inf")), axis=0))
    logprob = (x_tok - m) - tl.log(total.to(tl.float32))
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, logprob)
    # [2, B] float64 (token ids are exact in float64): the step's one copy to the host
    tl.store(Packed + row, token.to(tl.float64))
    tl.store(Packed + B + row, logprob.to(tl.float64))


def sample_unfiltered(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                      uniforms: torch.Tensor, launch: SamplerLaunch | None = None,
                      pack_on_host: bool = False, unit_temperature: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] float32, bf16 or fp16 (rows contiguous; read as exactly those values in
    float32), temperatures [B] float32 (1.0 on greedy rows),
    greedy [B] bool, uniforms [B] float64 → (tokens [B] int64, logprobs [B] float32, the two
    stacked as [2, B] float64 for the host). `launch`: `launch_for(B)` if None.

    `pack_on_host` (CUDA): `_pick` writes the [2, B] pack straight into pinned host memory,
    which the GPU reaches through unified addressing — no copy to the host after it (a copy
    engine's launch behind a kernel cost a batch-1 step ~6 µs). Its values are there once the
    stream has passed `_pick`: the caller reads them after an event recorded behind it.
    `unit_temperature`: the caller knows every row's T is 1 (the batch's host-side flag), so
    the kernels skip the division (the same values); UNIT_T_PER_ROW: each row skips it where
    its own T is 1."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    cmax = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    csum = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    packed = torch.empty(2, rows, dtype=torch.float64,
                         **({"pin_memory": True} if pack_on_host and dev.type == "cuda" else {"device": dev}))
    launch_into(logits, temperatures, greedy, uniforms, (cmax, csum), tokens, logprobs, packed,
                launch, unit_temperature)
    return tokens, logprobs, packed


def launch_into(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                uniforms: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor],
                tokens: torch.Tensor, logprobs: torch.Tensor, packed: torch.Tensor,
                launch: SamplerLaunch | None = None, unit_temperature: bool | int = False) -> None:
    """The two kernels of `sample_unfiltered` writing into the caller's buffers: stats, two
    [B, cdiv(V, CHUNK)] float32 scratch tensors; tokens [B] int64, logprobs [B] float32,
    packed [2, B] float64 (device or pinned host memory). What a CUDA graph that samples
    captures: its buffers stay where they are from replay to replay. `unit_temperature`: as
    `sample_unfiltered`'s, or UNIT_T_PER_ROW."""
    rows, vocab = logits.shape
    launch = launch or launch_for(rows)
    cmax, csum = stats
    chunks = triton.cdiv(vocab, CHUNK)
    wants = {"stats": ((rows, chunks), cmax.shape, csum.shape), "tokens": ((rows,), tokens.shape),
             "logprobs": ((rows,), logprobs.shape), "packed": ((2, rows), packed.shape)}
    for name, (shape, *got) in wants.items():
        if any(tuple(g) != shape for g in got):
            raise ValueError(f"sampler {name} buffer of shape {[tuple(g) for g in got]}, "
                             f"want {shape} for {rows} rows of {vocab} logits")
    stride, group = logits.stride(0), launch.chunks_per_program
    _chunk_stats[(rows, triton.cdiv(chunks, group))](
        logits, stride, temperatures, cmax, csum, vocab, chunks, CHUNK=CHUNK, GROUP=group,
        UNIT_T=int(unit_temperature), COMPILED=_COMPILED, num_warps=launch.stats_warps,
        **launch_options())
    _pick[(rows,)](logits, stride, temperatures, greedy, uniforms, cmax, csum, tokens,
                   logprobs, packed, rows, vocab, chunks, CHUNK=CHUNK,
                   BLOCK_C=triton.next_power_of_2(chunks), UNIT_T=int(unit_temperature),
                   COMPILED=_COMPILED, num_warps=launch.pick_warps, **launch_options())


_COMPILED = _is_compiled(_pick)  # False under TRITON_INTERPRET=1

__all__ = ["sample_unfiltered", "launch_into", "CHUNK", "SamplerLaunch", "UNIT_T_PER_ROW"]
