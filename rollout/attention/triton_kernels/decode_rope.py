"""The qkv epilogue inside the decode attention kernel: the rotary, the KV-cache write and the
split-K sum of qkv, done by the attention's own programs instead of a rotary kernel before it.

Why: at decode batches (17+ requests) the qkv GEMM hands its output (split-K partials and the
bias, or the summed output) to a rotary kernel that sums it, rotates q and k, writes the step's
keys and values into the KV cache and q back for the attention, which reads them again after
its PDL wait. That kernel is one more launch, wait and drain on a layer's chain of kernels. A
decode program (request b, KV head h, split) can compute the same values itself: its query
heads, and the key and value of KV head h, from the qkv output's row b, with the rotary kernel's
arithmetic (the partials summed in split order, + bias, rounded once; every rotary product its
own rounded value), so the attention sees the same bits. The program whose keys hold the new
token writes it into the cache; every block of keys takes the new token's key and value from
registers, never from the slot it writes.

Contract (`decode.decode_attention(..., rope=DecodeRope(...))`): qkv rows are
[q heads | k heads | v heads] of head_dim each (HF's rotate-half layout); cos/sin are a token's
half tables; `loc[b]` is the slot of request b's new token, the one at position seq_lens[b] - 1
(`req_to_token`'s entry there)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton.language as tl
import triton

from rollout.layers.triton_ops import _round, _split_sum


class DecodeRope(NamedTuple):
    """The step's qkv output and what its epilogue needs (`decode_attention(..., rope=)`)."""
    qkv: torch.Tensor  # fp32 split-K partials [S, batch, N] (bias not added), or [batch, N]
    bias: Optional[torch.Tensor]  # [N], added to the partials' sum (None: none, or summed in)
    cos: torch.Tensor  # [batch, 1, head_dim / 2], the output's dtype
    sin: torch.Tensor
    loc: torch.Tensor  # [batch] the new tokens' KV slots
    dtype: torch.dtype  # what qkv's values round to (the GEMM's output dtype)


def check_rope(rope: DecodeRope, batch: int, heads: int, kv_heads: int, head_dim: int,
               block_d: int) -> tuple[int, int, int]:
    """Validate the epilogue's inputs against a batch's heads; returns (splits, stride between
    splits, stride between tokens) of `rope.qkv`."""
    qkv, n = rope.qkv, (heads + 2 * kv_heads) * head_dim
    split = qkv.dim() == 3
    if (qkv.dim() not in (2, 3) or qkv.shape[-2:] != (batch, n) or qkv.stride(-1) != 1
            or (split and qkv.dtype != torch.float32)):
        raise ValueError(f"qkv {tuple(qkv.shape)} {qkv.dtype} does not fit {batch} rows of "
                         f"{heads} + 2 x {kv_heads} heads of {head_dim} (fp32 partials "
                         f"[S, rows, N] or [rows, N])")
    if head_dim % 2 or block_d != head_dim:
        raise ValueError(f"the rotary epilogue needs an even power-of-two head_dim >= 16, got "
                         f"{head_dim}")
    for c in (rope.cos, rope.sin):
        if c.shape != (batch, 1, head_dim // 2) or c.stride(2) != 1:
            raise ValueError(f"cos/sin {tuple(c.shape)} do not fit {batch} rows of "
                             f"{head_dim}-dim heads")
    if rope.loc.shape != (batch,):
        raise ValueError(f"loc {tuple(rope.loc.shape)}: one KV slot per request wanted")
    if rope.bias is not None and (rope.bias.shape != (n,) or not rope.bias.is_contiguous()):
        raise ValueError(f"bias {tuple(rope.bias.shape)} does not fit {n} qkv columns")
    return (qkv.shape[0], qkv.stride(0), qkv.stride(1)) if split else (1, 0, qkv.stride(0))


@triton.jit
def qkv_values(P, Bias, row, cols, mask, stride_split, SPLIT: tl.constexpr,
               HAS_BIAS: tl.constexpr, dt: tl.constexpr, COMPILED: tl.constexpr):
    """qkv's output at columns `cols` of the row starting at `row`: the partials summed in split
    order, + bias, rounded to dt (a summed output: read and rounded, i.e. unchanged)."""
    return _split_sum(P, Bias, row + cols, cols, stride_split, mask,
                      tl.full(cols.shape, 0.0, tl.float32), SPLIT, HAS_BIAS, dt, COMPILED)


@triton.jit
def rotated(P, Bias, row, cols, partner, mask, cos, sin, first_half, stride_split,
            SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, dt: tl.constexpr,
            COMPILED: tl.constexpr):
    """The rotary of qkv's values at `cols`, whose rotate-half partners are at `partner` (d ±
    head_dim / 2): x·cos − x'·sin in the first half, x·cos + x'·sin in the second, every
    product rounded to dt and then the sum, as the rotary kernel computes it."""
    x = qkv_values(P, Bias, row, cols, mask, stride_split, SPLIT, HAS_BIAS, dt, COMPILED)
    xr = qkv_values(P, Bias, row, partner, mask, stride_split, SPLIT, HAS_BIAS, dt, COMPILED)
    r = _round(xr * sin, dt, COMPILED)
    return _round(_round(x * cos, dt, COMPILED) + tl.where(first_half, -r, r), dt, COMPILED)
