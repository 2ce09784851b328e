"""A sparse mixture-of-experts MLP (Qwen3-MoE), tensor-parallel like the dense MLP.

The router is replicated; every rank holds all experts, each narrowed to its share of the expert
width (gate|up rows, down columns), and the partial outputs are all-reduced: the same split as
the dense MLP's, so TP needs no token exchange.

A step routes its T tokens to T·top_k (token, expert) rows, sorts them by expert and runs the
experts as two grouped GEMMs (`F.grouped_mm`, one launch each for all experts) over the sorted
rows: no Python loop over experts, no host synchronisation (CUDA-graph capturable), each
selected expert's weights read once a step. CUDA steps of few tokens (decode) take the three
Triton kernels of `triton_moe` instead."""
from __future__ import annotations

from typing import Hashable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout.config import MoEConfig
from rollout.distributed import SINGLE, TPGroup
from rollout.forward_batch import ForwardBatch
from rollout.layers.weight_attrs import copy_into, make_param, replicated_loader

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# (device type, dtype) pairs where the grouped GEMM raised once: they take the gathered form
_NO_GROUPED_MM: set[tuple[str, torch.dtype]] = set()
GATHER_BYTES = 256 << 20  # the gathered form's expert copies at once


class FusedExperts(nn.Module):
    """All experts' weights as two 3-D parameters, named as Hugging Face's fused experts are:
    `gate_up_proj` [E, 2·I/tp, H] (this rank's gate rows, then its up rows) and `down_proj`
    [E, H, I/tp]. Each also loads from the per-expert checkpoint names
    (`{e}.gate_proj.weight`, `{e}.up_proj.weight`, `{e}.down_proj.weight`)."""

    def __init__(self, num_experts: int, hidden: int, width: int, tp: TPGroup = SINGLE):
        super().__init__()
        if width % tp.size:
            raise ValueError(f"tp_size={tp.size} must divide moe_intermediate_size={width}")
        self.width, self.start, self.local = width, *tp.shard_range(width)
        e = num_experts
        self.gate_up_proj = make_param((e, 2 * self.local, hidden), self._load_gate_up,
                                       {None: (e, 2 * width, hidden)})
        self.gate_up_proj.hf_pieces = [(f"{i}.{name}.weight", (i, half), (width, hidden))
                                       for i in range(e)
                                       for half, name in enumerate(("gate_proj", "up_proj"))]
        self.down_proj = make_param((e, hidden, self.local), self._load_down,
                                    {None: (e, hidden, width)})
        self.down_proj.hf_pieces = [(f"{i}.down_proj.weight", (i,), (hidden, width))
                                    for i in range(e)]

    def _load_gate_up(self, param: nn.Parameter, full: torch.Tensor, shard_id: Hashable) -> None:
        if shard_id is None:  # [E, 2I, H]: gate rows then up rows of every expert
            for half in (0, 1):
                copy_into(param.data.narrow(1, half * self.local, self.local),
                          full.narrow(1, half * self.width + self.start, self.local))
            return
        expert, half = shard_id  # one expert's gate or up [I, H]
        copy_into(param.data[expert].narrow(0, half * self.local, self.local),
                  full.narrow(0, self.start, self.local))

    def _load_down(self, param: nn.Parameter, full: torch.Tensor, shard_id: Hashable) -> None:
        if shard_id is None:  # [E, H, I]
            copy_into(param.data, full.narrow(2, self.start, self.local))
            return
        copy_into(param.data[shard_id[0]], full.narrow(1, self.start, self.local))


class SparseMoE(nn.Module):
    """Router (`gate`, HF's `mlp.gate.weight`) + experts. The routing follows HF's: softmax in
    float32 over the router logits, top_k, optionally renormalised, in the model dtype."""

    def __init__(self, cfg: MoEConfig, hidden: int, tp: TPGroup = SINGLE, record_index: int = 0):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.record_index = record_index  # this layer's row of a RoutingPool
        self.gate = nn.Module()
        self.gate.weight = make_param((cfg.num_experts, hidden), replicated_loader,
                                      {None: (cfg.num_experts, hidden)})
        self.experts = FusedExperts(cfg.num_experts, hidden, cfg.intermediate_size, tp)

    def forward(self, x: torch.Tensor, fb: Optional[ForwardBatch] = None) -> torch.Tensor:
        """`fb`: the step's batch, whose KV pool may record the routing (`routing_record`)."""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        routing = fb.token_to_kv_pool.routing if fb is not None else None
        form = _triton_form(x, gate_up) if x.is_cuda else None
        if form is not None:  # decode: three Triton kernels (few tokens), or sorted blocks
            from rollout.layers import triton_moe
            record = ((routing.layer(self.record_index), fb.out_cache_loc)
                      if routing is not None else None)  # written by the routing kernel
            weights, experts = triton_moe.route(F.linear(x, self.gate.weight), self.cfg.top_k,
                                                self.cfg.norm_topk_prob, x.dtype, record)
            out = form(x, weights, experts, gate_up, down)
        else:
            weights, experts = self.route(x)
            out = moe_experts(x, weights, experts, gate_up, down)
            if routing is not None:
                routing.record(self.record_index, fb.out_cache_loc, experts)
        if self.tp.size > 1:  # partial sums over the expert width, rounded once after the sum
            out = self.tp.all_reduce(out)
        return out.to(x.dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, top_k] in x's dtype, expert ids [T, top_k])."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids


def _triton_form(x: torch.Tensor, gate_up: torch.Tensor):
    """The `triton_moe` experts function for this step, or None (the grouped GEMMs)."""
    from rollout.layers import triton_moe  # lazily: triton only where CUDA runs
    if triton_moe.applies(x, gate_up):
        return triton_moe.experts
    return triton_moe.experts_blocked if triton_moe.blocks_apply(x, gate_up) else None


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[t, k] · down_e(silu(gate_e(x_t)) · up_e(x_t)) for e = experts[t, k], as a
    float32 [T, H] (the top_k terms summed in float32). `gate_up` [E, 2W, H], `down` [E, H, W]."""
    tokens, top_k = experts.shape
    flat = experts.reshape(-1).long()
    order, counts = group_by_expert(flat, gate_up.shape[0])
    rows = x[order // top_k]
    key = (x.device.type, x.dtype)
    if _GROUPED_MM is not None and key not in _NO_GROUPED_MM:
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        out = _grouped(rows, ends, gate_up, down, key)
    else:
        out = None
    if out is None:
        out = _gathered(rows, flat[order], gate_up, down)
    per_row = torch.empty_like(out).index_copy_(0, order, out)  # back to (token, k) order
    per_row = per_row.view(tokens, top_k, -1).float() * weights.unsqueeze(-1).float()
    return per_row.sum(dim=1)


def group_by_expert(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order: the routed rows' indices grouped by expert, stable; rows per expert [E] int64)
    for expert ids `flat` [rows] int64. The counts by a scatter, not bincount, which reads its
    max back to the host on CUDA: device ops only."""
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def _grouped(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             key: tuple[str, torch.dtype]) -> Optional[torch.Tensor]:
    """The experts as two grouped GEMMs; None where this device / dtype has none (remembered)."""
    try:
        h = _GROUPED_MM(rows, gate_up.transpose(1, 2), offs=ends)
        return _GROUPED_MM(_silu_mul(h), down.transpose(1, 2), offs=ends)
    except (RuntimeError, NotImplementedError, TypeError):
        _NO_GROUPED_MM.add(key)
        return None


def _gathered(rows: torch.Tensor, expert_of_row: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """The fallback for devices and dtypes without a grouped GEMM: each row's expert weights
    gathered, batched GEMVs. It reads an expert once per row that picked it, so rows go in
    chunks whose gathered weights stay under GATHER_BYTES."""
    per_row = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    chunk = max(1, GATHER_BYTES // per_row)
    return torch.cat([_gathered_chunk(rows[i:i + chunk], expert_of_row[i:i + chunk], gate_up, down)
                      for i in range(0, rows.shape[0], chunk)])


def _gathered_chunk(rows: torch.Tensor, expert_of_row: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    h = torch.bmm(gate_up[expert_of_row], rows.unsqueeze(-1)).squeeze(-1)
    return torch.bmm(down[expert_of_row], _silu_mul(h).unsqueeze(-1)).squeeze(-1)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
