"""CPU GEMMs through oneDNN.

fp32 GEMMs above a small size go through oneDNN (`cpu_linear`) instead of torch's default BLAS
(MKL): on the AMD development machine MKL's sgemm runs at about half of oneDNN's speed from 4
rows up (and its GEMV is slower for the large matrices too). Given the plain Parameter, oneDNN
reorders it into its blocked layout on every call; the model passes a copy packed once instead
(`pack_cpu_weight`, cached by `packed_weights.PackedWeights`, which every weight write empties),
and the MLP's gate/up GEMMs carry SiLU and the product as oneDNN post-ops (`cpu_gate_up_silu`)."""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from rollout.layers.one_row_blas import ONE_ROW_BLAS


def _onednn_linear_op():
    if os.environ.get("ROLLOUT_CPU_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a torch build without it
        return None


_ONEDNN_LINEAR = _onednn_linear_op()
_ONEDNN_BINARY = torch.ops.mkldnn._linear_pointwise.binary if _ONEDNN_LINEAR is not None else None
# rows x out x in from which oneDNN beats MKL on CPU. In a loop over one small GEMV, caches hot,
# MKL wins below ~2^19 (oneDNN's per-call cost is ~10 us); inside a decode step, where every
# weight comes from memory, oneDNN wins from much smaller sizes: with the cpu-small shape's
# qkv/o/down GEMVs (98k, 65k, 262k multiply-adds) on oneDNN too, a batch-1 generate ran 6.5%
# faster than with them on MKL (same process, interleaved, medians of 6; 3% at batch 4).
ONEDNN_MIN_WORK = 1 << 15


def pack_cpu_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN's blocked copy of a CPU fp32 weight [out, in], for `cpu_linear(..., packed=)`; None
    where `cpu_linear` would not use oneDNN. The same GEMM results bit for bit as the plain
    weight (oneDNN reorders it the same way on every call otherwise)."""
    if (_ONEDNN_LINEAR is None or weight.device.type != "cpu" or weight.dtype != torch.float32
            or weight.dim() != 2 or weight.numel() == 0):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (AttributeError, RuntimeError):  # a torch build without it
        return None


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               packed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear: one row through OpenBLAS while `ONE_ROW_BLAS` is entered (batch-1 decode), else
    through oneDNN for fp32 CPU GEMMs of at least ONEDNN_MIN_WORK multiply-adds when
    no autograd is needed (the engine runs under inference_mode). Results are IEEE fp32 like
    MKL's, summed in another order (ulp-level differences, as between two BLAS libraries).
    `packed`: `pack_cpu_weight(weight)`, used for a 2-D x (at any row count: a decode batch of 4
    ran 26% faster with it, one of 1 2%, in-engine A/B on the cpu-small shape)."""
    global _ONEDNN_LINEAR
    array = ONE_ROW_BLAS.array_for(x, weight)
    if array is not None:
        return ONE_ROW_BLAS.gemv(x, array, bias)
    if (packed is not None and _ONEDNN_LINEAR is not None and x.dim() == 2
            and x.dtype == torch.float32 and not torch.is_grad_enabled()):
        return _ONEDNN_LINEAR(x, packed, bias, "none", [], "")
    if (_ONEDNN_LINEAR is None or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or torch.is_grad_enabled()
            or x.numel() * weight.shape[0] < ONEDNN_MIN_WORK):
        return F.linear(x, weight, bias)
    try:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    except RuntimeError:  # an input oneDNN refuses: never try again, the result is the same
        _ONEDNN_LINEAR = None
        return F.linear(x, weight, bias)


def cpu_gate_up_silu(x: torch.Tensor, packed_gate: torch.Tensor, packed_up: torch.Tensor) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) as two oneDNN GEMMs with post-ops (SiLU on the first, the product
    with it on the second), from the packed halves of the fused gate/up weight: no separate
    SiLU and multiply passes over [rows, inter], which at 64 rows cost ~60 µs a layer here.
    oneDNN's SiLU is within an fp32 ulp or two of torch's."""
    return _ONEDNN_BINARY(x, _ONEDNN_LINEAR(x, packed_gate, None, "swish", [], ""), packed_up, None, "mul")
