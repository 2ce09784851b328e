"""Batch-1 decode layers as one persistent kernel each (`fused_layer_kernel`): config, scratch,
eligibility, and the launch.

`FusedDecodeLayers` belongs to one model on one device. It takes a decode step of one request
when every layer fits the kernel (Llama / Qwen2 layers without per-head q/k norms, one
tensor-parallel rank, the Triton attention backend's flat KV pool, 16-bit or fp32 weights):
`run` replaces the layer loop, one launch a layer, and returns (h, residual) for the final
norm. On a GPU the grid is `programs_per_sm` programs on every SM, all resident (checked from
the compiled kernel's registers and shared memory before the first launch: the grid barriers
would otherwise wait forever); under the CPU interpreter each layer runs as five launches, one
per phase, in order (only where ROLLOUT_FUSED_LAYER=1 asks: the CPU engine's own batch-1 path
is faster). ROLLOUT_FUSED_LAYER=0 turns it off."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from rollout.attention.triton_kernels.common import block_dmodel, dot_precision
from rollout.layers.fused_layer_kernel import CTR_SLOTS, fused_layer_kernel
from rollout.layers.triton_ops import _is_compiled
from rollout.triton_pdl import launch_options

logger = logging.getLogger(__name__)

_COMPILED = _is_compiled(fused_layer_kernel)
PHASES = 5
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class FusedLayerConfig:
    # defaults: the fastest of benchmarks/gpu_fused_layer.py's sweep on an H200 (45.3 µs a layer)
    programs_per_sm: int = 2  # GPU grid: this many programs on every SM (all resident)
    num_warps: int = 4
    block_k: int = 512  # K chunk of a weight tile
    block_n: int = 8  # weight rows of a tile (at most: fewer where a program has fewer rows)
    num_stages: int = 3  # the GEMV loops' pipeline: num_stages - 1 tiles in flight a program
    block_keys: int = 32  # keys per attention step
    num_splits: int = 8  # KV splits per KV head
    programs: int = 4  # interpreter grid (CPU)

    def __post_init__(self) -> None:
        for name in ("num_warps", "block_k", "block_n", "block_keys", "num_splits"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"FusedLayerConfig.{name} must be a power of two, got "
                                 f"{getattr(self, name)}")
        if self.programs_per_sm < 1 or self.programs < 1 or self.num_stages < 1:
            raise ValueError("FusedLayerConfig: programs_per_sm, programs and num_stages must "
                             "be >= 1")
        if self.block_keys < 16:
            raise ValueError("FusedLayerConfig.block_keys must be >= 16 (tl.dot)")

    @classmethod
    def parse(cls, spec: str) -> "FusedLayerConfig":
        """From "name=value,..." (e.g. "programs_per_sm=1,num_warps=8"): another GPU's launch
        without a code change."""
        fields = {}
        for item in filter(None, spec.replace(" ", "").split(",")):
            name, _, value = item.partition("=")
            if name not in cls.__dataclass_fields__ or not value.isdigit():
                raise ValueError(f"fused layer config {item!r}: want name=int with name one of "
                                 f"{sorted(cls.__dataclass_fields__)}")
            fields[name] = int(value)
        return cls(**fields)


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


class LayerScratch:
    """The kernel's intermediate rows and counters, one set shared by every layer (layers run
    one after another); allocated once, so a CUDA graph keeps their addresses."""

    def __init__(self, shape: LayerShape, num_layers: int, num_splits: int, programs: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        def empty(n, dt=dtype):
            return torch.empty(n, dtype=dt, device=device)
        self.qkv, self.r1 = empty(shape.qkv_rows), empty(shape.hidden)
        self.xn = empty(programs * shape.hidden)  # each program's normed input row
        self.att, self.act = empty(shape.heads * shape.head_dim), empty(shape.inter)
        self.h, self.residual = empty((1, shape.hidden)), empty((1, shape.hidden))
        self.part_o = empty(shape.heads * num_splits * shape.head_dim, torch.float32)
        self.part_lse = empty(shape.heads * num_splits, torch.float32)
        self.counters = torch.zeros(num_layers, CTR_SLOTS, dtype=torch.int32, device=device)


def layer_weights(layer) -> tuple[torch.Tensor, ...]:
    """(norm1, qkv, qkv bias or None, o, norm2, gate_up, down) of a DecoderLayer."""
    a, m = layer.self_attn, layer.mlp
    return (layer.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias, a.o_proj.weight,
            layer.post_attention_layernorm.weight, m.gate_up_proj.weight, m.down_proj.weight)


def unsupported_reason(model, fb, h: torch.Tensor) -> Optional[str]:
    """Why this step cannot take the fused layers (None: it can)."""
    from rollout.attention.triton_backend import TritonBackend
    switch = os.environ.get("ROLLOUT_FUSED_LAYER")
    if switch == "0":
        return "ROLLOUT_FUSED_LAYER=0"
    if not h.is_cuda and (_COMPILED or switch != "1"):
        return "off a GPU (ROLLOUT_FUSED_LAYER=1 runs it under the Triton interpreter)"
    if not fb.forward_mode.is_decode or h.shape[0] != 1:
        return "not a one-request decode step"
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {h.dtype}"
    if not isinstance(fb.attn_backend, TritonBackend) or fb.attn_backend.meta is None:
        return "not the Triton attention backend"
    layer = model.layers[0]
    a, m = layer.self_attn, layer.mlp
    if a.q_norm is not None or a.o_proj.tp.size != 1:
        return "per-head q/k norms or tensor parallelism"
    if a.o_proj.bias is not None or m.down_proj.bias is not None or m.gate_up_proj.bias is not None:
        return "bias outside qkv"
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return "norms with different eps"
    pool = fb.token_to_kv_pool
    k0 = pool.k_buffers[0]
    if not k0.is_contiguous() or k0.dtype != h.dtype or a.attn.head_dim % 2:
        return "KV cache layout or dtype"
    return None


class FusedDecodeLayers:
    """Runs a model's layers for one-request decode steps (see the module docstring)."""

    def __init__(self, shape: LayerShape, eps: float, num_layers: int,
                 config: FusedLayerConfig = FusedLayerConfig()) -> None:
        self.shape, self.eps, self.num_layers, self.config = shape, eps, num_layers, config
        self._scratch: Optional[LayerScratch] = None
        self._grid: Optional[int] = None
        self.compiled = None  # the compiled GPU kernel, once its occupancy is checked

    @classmethod
    def for_model(cls, model, config: Optional[FusedLayerConfig] = None) -> "FusedDecodeLayers":
        """For a DecoderModel; the config from ROLLOUT_FUSED_LAYER_CONFIG if set, else the
        default."""
        if config is None:
            spec = os.environ.get("ROLLOUT_FUSED_LAYER_CONFIG")
            config = FusedLayerConfig.parse(spec) if spec else FusedLayerConfig()
        layer = model.layers[0]
        a = layer.self_attn
        shape = LayerShape(a.qkv_proj.weight.shape[1], a.heads, a.kv_heads, a.attn.head_dim,
                           layer.mlp.inter)
        return cls(shape, layer.input_layernorm.eps, len(model.layers), config)

    def run(self, layers, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the one-row h [1, hidden] (the embedding): (h, residual) out."""
        s = self.scratch_for(h)
        meta, pool = fb.attn_backend.meta, fb.token_to_kv_pool
        s.counters.zero_()
        for i, layer in enumerate(layers):
            launch_layer(self, s, layer_weights(layer), h if i == 0 else s.h, i > 0, i, rope,
                         pool.k_buffers[i], pool.v_buffers[i], fb.out_cache_loc,
                         fb.attn_backend.req_to_token, meta.req_pool_indices, meta.seq_lens,
                         layer.self_attn.attn.scaling)
        return s.h, s.residual

    def scratch_for(self, h: torch.Tensor) -> LayerScratch:
        s = self._scratch
        if s is None or s.h.device != h.device or s.h.dtype != h.dtype:
            s = LayerScratch(self.shape, self.num_layers, self.config.num_splits,
                             self.programs(h.device), h.dtype, h.device)
            self._scratch = s
        return s

    def programs(self, device: torch.device) -> int:
        """The grid: the interpreter's, or programs_per_sm on every SM."""
        if self._grid is None:
            self._grid = self.config.programs if not _COMPILED else (
                self.config.programs_per_sm
                * torch.cuda.get_device_properties(device).multi_processor_count)
        return self._grid

    def check_resident(self, args: tuple, constexprs: dict) -> None:
        """Before the first launch: the compiled kernel must fit programs_per_sm programs on an
        SM (registers, shared memory), or its grid barriers would wait forever."""
        if self.compiled is not None or not _COMPILED:
            return
        kernel = fused_layer_kernel.warmup(*args, grid=(1,), **constexprs)
        kernel._init_handles()
        fits = resident_programs(kernel, args[0].device, self.config.num_warps)
        if fits < self.config.programs_per_sm:
            raise RuntimeError(
                f"fused decode layer: {self.config.programs_per_sm} programs an SM asked, {fits} "
                f"fit ({kernel.n_regs} registers a thread, {kernel.metadata.shared} B shared)")
        self.compiled = kernel


def resident_programs(kernel, device: torch.device, num_warps: int) -> int:
    """How many programs of a compiled kernel fit on one SM at once."""
    props = torch.cuda.get_device_properties(device)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    threads = 32 * num_warps
    regs_per_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256  # allocated per warp, in 256s
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = smem_per_sm // max(kernel.metadata.shared, 1)
    return min(by_regs, by_smem, MAX_THREADS_PER_SM // threads, MAX_BLOCKS_PER_SM)


def _block_n(rows: int, programs: int, cap: int) -> int:
    """Rows of a tile: the program's share of the rows, rounded up to a power of two, capped."""
    return min(cap, triton.next_power_of_2(max(1, -(-rows // programs))))


def launch_layer(owner: FusedDecodeLayers, s: LayerScratch, weights: tuple, h_in: torch.Tensor,
                 has_residual: bool, layer_id: int, rope, k_buf, v_buf, loc, req_to_token,
                 req_pool_indices, seq_lens, sm_scale: float, last_phase: int = PHASES - 1) -> None:
    """One layer: reads h_in (+ s.residual), writes s.h and s.residual. `last_phase` < 4 stops
    early (benchmarks/gpu_fused_layer.py times the phases that way)."""
    norm1, qkv_w, qkv_b, o_w, norm2, gu_w, down_w = weights
    shape, cfg = owner.shape, owner.config
    cos, sin = rope
    args = (h_in, s.residual, s.h, s.residual, norm1, qkv_w,
            qkv_b if qkv_b is not None else norm1, o_w, norm2, gu_w, down_w,
            cos, sin, k_buf, v_buf, loc, req_to_token, req_pool_indices, seq_lens,
            s.qkv, s.r1, s.xn, s.att, s.part_o, s.part_lse, s.act, s.counters[layer_id],
            owner.eps, 1.0 / shape.hidden, sm_scale, req_to_token.stride(0))
    group = shape.heads // shape.kv_heads
    constexprs = dict(
        HIDDEN=shape.hidden, BLOCK_HID=triton.next_power_of_2(shape.hidden), HEADS=shape.heads,
        KV_HEADS=shape.kv_heads, HEAD_DIM=shape.head_dim, INTER=shape.inter, BK=cfg.block_k,
        BLOCK_D=block_dmodel(shape.head_dim), BLOCK_H=max(16, triton.next_power_of_2(group)),
        STAGES=cfg.num_stages, BLOCK_KEYS=cfg.block_keys, NUM_SPLITS=cfg.num_splits, PRECISION=dot_precision(h_in.dtype),
        HAS_RESIDUAL=has_residual, HAS_QKV_BIAS=qkv_b is not None, THREADS=32 * cfg.num_warps, COMPILED=_COMPILED,
        num_warps=cfg.num_warps)
    programs = owner.programs(h_in.device)
    constexprs |= _tile_rows(shape, cfg, programs)
    if _COMPILED:
        sync = dict(FIRST=0, LAST=last_phase, SYNC=True, **launch_options())
        owner.check_resident(args, constexprs | sync)
        fused_layer_kernel[(programs,)](*args, **constexprs, **sync)
    else:  # the interpreter runs programs one at a time: one launch a phase, no barriers
        for phase in range(last_phase + 1):
            fused_layer_kernel[(programs,)](*args, **constexprs, FIRST=phase, LAST=phase,
                                            SYNC=False, USE_PDL=False)


def _tile_rows(shape: LayerShape, cfg: FusedLayerConfig, programs: int) -> dict:
    cap = cfg.block_n
    return dict(BN_QKV=_block_n(shape.qkv_rows, programs, cap),
                BN_O=_block_n(shape.hidden, programs, cap),
                BN_GU=_block_n(shape.inter, programs, cap),
                BN_DOWN=_block_n(shape.hidden, programs, cap))
