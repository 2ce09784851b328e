"""Megatron-style tensor-parallel linear layers. With tp.size == 1 they are plain linears.

`linear` is F.linear on either device: CPU GEMMs go through oneDNN (`cpu_gemm`), single-row CUDA
GEMMs through the Triton skinny-GEMM kernels (`triton_gemv`), the rest through cuBLAS."""
from __future__ import annotations

import os
from typing import Hashable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed import SINGLE, TPGroup
from rollout.layers.cpu_gemm import cpu_linear
from rollout.layers.split_sum import SplitSum
from rollout.layers.weight_attrs import copy_into, make_param, replicated_loader


# CUDA: single-row GEMMs (decode at batch 1) in 16-bit dtypes go to the Triton skinny-GEMM
# kernels (`triton_gemv`): they are bound by reading the weight, and cuBLAS's GEMVs for these
# shapes leave a quarter to half of the bandwidth unused. Measured in the engine on an H200
# (docs/BENCHMARKS.md): batch 1 +9-18%. Small batches (2-16 rows: a rollout's tail, few
# requests left) and decode batches from BATCH_MIN_ROWS go to the kernels only at the (shape,
# rows) their tuned table lists as faster than cuBLAS (an early session found no gain at 4 and
# 16 rows with the untuned heuristic; the forty-first session none at 2 and 4 rows of Qwen3-8B
# with the one-row rule, nor at 32 and 128 of Qwen3-4B with Qwen3-1.7B's tiles).
# ROLLOUT_SKINNY_GEMM=0: cuBLAS only.
SKINNY_GEMM = os.environ.get("ROLLOUT_SKINNY_GEMM", "1") != "0"
# A skinny GEMM split along K may hand its fp32 partials to a reader that sums them itself (the
# residual add + RMSNorm after down and o, the rotary kernel after qkv: `defer_split`), saving
# the reduce kernel.
# ROLLOUT_DEFER_SPLIT_K=0: always reduce in the GEMM.
DEFER_SPLIT_K = os.environ.get("ROLLOUT_DEFER_SPLIT_K", "1") != "0"
SKINNY_MAX_ROWS = 1  # rows the kernels serve without a tuned entry (gemv_launch.one_row_rule)
BATCH_MIN_ROWS = 17  # decode batches from here (the M-tiled kernels), where tuned


def use_skinny(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """One-row GEMMs, and more rows where the tuned table says the kernel (for `gated`, the
    fused gate/up + SiLU one) beats cuBLAS (+ the SiLU kernel) (`triton_gemv.supports`)."""
    if not (SKINNY_GEMM and x.is_cuda and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    from rollout.layers import triton_gemv  # lazily: triton only where CUDA runs
    rows = x.shape[0]
    if SKINNY_MAX_ROWS < rows < BATCH_MIN_ROWS and not triton_gemv.is_tuned(x, weight, gated):
        return False
    return triton_gemv.supports(x, weight, gated)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           packed: Optional[torch.Tensor] = None,
           defer_split: bool = False) -> Union[torch.Tensor, SplitSum]:
    """F.linear on either device: CPU through `cpu_linear`, CUDA through the skinny-GEMM kernels
    where `use_skinny` says so, else cuBLAS. `defer_split`: the caller's reader takes a SplitSum
    (a skinny GEMM split along K then returns its partials unsummed)."""
    if not x.is_cuda:
        return cpu_linear(x, weight, bias, packed)
    if use_skinny(x, weight):
        from rollout.layers import triton_gemv
        return triton_gemv.skinny_linear(x, weight, bias,
                                         defer_split=defer_split and DEFER_SPLIT_K)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by output rows; each rank keeps its rows, no communication.

    `shard_sizes` lists the output sizes of the HF tensors fused into this one (their ids
    `shard_ids`), e.g. gate/up; each is split over ranks on its own so rank r holds
    [gate_r; up_r]."""

    def __init__(self, in_features: int, shard_sizes: Sequence[int], bias: bool,
                 tp: TPGroup = SINGLE, shard_ids: Optional[Sequence[Hashable]] = None):
        super().__init__()
        self.tp = tp
        self.shard_ids = list(shard_ids) if shard_ids is not None else [None]
        self.full_sizes = dict(zip(self.shard_ids, shard_sizes))
        self.local_sizes = {k: tp.shard_range(n)[1] for k, n in self.full_sizes.items()}
        offsets, acc = {}, 0
        for k in self.shard_ids:
            offsets[k], acc = acc, acc + self.local_sizes[k]
        self.local_offsets = offsets
        self.weight = make_param((acc, in_features), self.weight_loader,
                                 {k: (n, in_features) for k, n in self.full_sizes.items()})
        self.bias = make_param((acc,), self.weight_loader,
                               {k: (n,) for k, n in self.full_sizes.items()}) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Hashable = None) -> None:
        start, length = self.tp.shard_range(self.full_sizes[shard_id])
        dst = param.data.narrow(0, self.local_offsets[shard_id], length)
        copy_into(dst, full.narrow(0, start, length))

    def forward(self, x: torch.Tensor, defer_split: bool = False) -> Union[torch.Tensor, SplitSum]:
        """`defer_split`: the caller's reader sums split-K partials itself (`linear`)."""
        return linear(x, self.weight, self.bias, defer_split=defer_split)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused gate_proj + up_proj (shard ids 0 and 1)."""

    def __init__(self, in_features: int, sizes: Sequence[int], bias: bool, tp: TPGroup = SINGLE):
        super().__init__(in_features, sizes, bias, tp, shard_ids=list(range(len(sizes))))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projections (shard ids 'q', 'k', 'v'); each rank keeps whole heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup = SINGLE):
        if num_heads % tp.size or num_kv_heads % tp.size:
            raise ValueError(f"tp_size={tp.size} must divide num_heads={num_heads} "
                             f"and num_kv_heads={num_kv_heads}")
        sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        super().__init__(hidden, sizes, bias, tp, shard_ids=("q", "k", "v"))
        self.q_size, self.kv_size = (self.local_sizes[k] for k in ("q", "k"))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.in_start, in_local = tp.shard_range(in_features)
        self.weight = make_param((out_features, in_local), self.weight_loader,
                                 {None: (out_features, in_features)})
        self.bias = make_param((out_features,), replicated_loader,
                               {None: (out_features,)}) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Hashable = None) -> None:
        copy_into(param.data, full.narrow(1, self.in_start, param.shape[1]))

    fp32_partials_supported = True  # False once torch.mm(..., out_dtype=) is found missing

    def forward(self, x: torch.Tensor, defer_split: bool = False) -> Union[torch.Tensor, SplitSum]:
        """`defer_split`: the caller's reader sums split-K partials itself (one rank, no bias)."""
        if (self.tp.size > 1 and x.is_cuda and x.dtype != torch.float32
                and RowParallelLinear.fp32_partials_supported):
            out = self._reduce_in_fp32(x)
        elif self.tp.size == 1 and self.bias is None:
            return linear(x, self.weight, defer_split=defer_split)
        else:
            out = self.tp.all_reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def _reduce_in_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """Partial sums leave the GEMM in fp32 and are rounded once, after the all-reduce: the
        result then differs from the unsharded layer (and from a trainer's full GEMM) only by
        fp32 summation order, not by one extra bf16 rounding per rank. Costs 2x the bytes of a
        bf16 all-reduce, which is latency-bound at decode sizes anyway."""
        flat = x.reshape(-1, x.shape[-1])
        try:
            partial = torch.mm(flat, self.weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # older torch: first (eager) call
            RowParallelLinear.fp32_partials_supported = False
            return self.tp.all_reduce(F.linear(x, self.weight))
        return self.tp.all_reduce(partial).to(x.dtype).view(*x.shape[:-1], -1)
