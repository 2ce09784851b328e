"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 differ only by flags; a config with experts gets
sparse MoE MLPs, `layers.moe`), tensor-parallel ready."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from rollout import pdl_policy
from rollout.config import ModelConfig
from rollout.distributed import SINGLE, TPGroup
from rollout.forward_batch import ForwardBatch
from rollout.layers.attention import Attention
from rollout.layers.cpu_gemm import cpu_gate_up_silu, cpu_linear
from rollout.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rollout.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                   use_skinny)
from rollout.layers.moe import SparseMoE
from rollout.layers.norm import RMSNorm, rms_norm_ref
from rollout.layers.one_row_blas import ONE_ROW_BLAS
from rollout.layers.packed_weights import PackedWeights
from rollout.layers.rotary import RotaryEmbedding, apply_rotary_full_
from rollout.layers.split_sum import SplitSum
from rollout.models.weight_table import WeightTable


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, qk_norm: bool):
        super().__init__()
        d = cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads // tp.size, cfg.num_key_value_heads // tp.size
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, False, tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.attn = Attention(layer_id, self.heads, self.kv_heads, d)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                fb: ForwardBatch) -> Union[torch.Tensor, SplitSum]:
        qk, v, kv_stored = (self._qkv_rotary_cuda(rope, x, fb) if x.is_cuda
                            else self._qkv_rotary_cpu(rope, x))
        return self._attend(qk, v, kv_stored, fb)

    def forward_normed(self, rope: tuple[torch.Tensor, torch.Tensor],
                       h: Union[torch.Tensor, SplitSum], residual: torch.Tensor, norm: RMSNorm,
                       fb: ForwardBatch) -> tuple[Union[torch.Tensor, SplitSum], torch.Tensor]:
        """(forward(norm(h + residual)), h + residual): at one row on CUDA the add + norm in the
        qkv kernel where triton_norm_qkv_rope applies (with the rotary and the KV store, or,
        Qwen3, before its q/k norms' rotary kernel), else the norm's own kernel first."""
        fused = self._fused_norm_qkv_rope(rope, h, residual, norm, fb)
        if fused is not None:
            qkv, residual = fused
            return self._attend(*self._heads(qkv), True, fb), residual
        fused = self._fused_norm_qkv(h, residual, norm)
        if fused is not None:
            qkv, residual = fused
            return self._attend(*self._rotary_cuda(rope, qkv, fb), fb), residual
        x, residual = norm(h, residual)
        return self.forward(rope, x, fb), residual

    def _attend(self, qk: torch.Tensor, v: torch.Tensor, kv_stored: bool,
                fb: ForwardBatch) -> Union[torch.Tensor, SplitSum]:
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        out = self.attn(q, k, v, fb, kv_stored)
        # o lets the kernels after it launch before its PDL wait, even at one row where its GEMV
        # preloads weights: the MLP's gate/up then loads its weights during o (pdl_policy).
        # Read by the post-attention add + RMSNorm, which can sum split-K partials itself.
        with pdl_policy.preloaders_early():
            return self.o_proj(out, defer_split=True)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q and k heads [n, heads + kv_heads, d], v heads [n, kv_heads, d]) views of qkv."""
        n, d = qkv.shape[0], self.attn.head_dim
        qk, v = qkv.split([self.qkv_proj.q_size + self.qkv_proj.kv_size,
                           self.qkv_proj.kv_size], dim=-1)
        return qk.view(n, self.heads + self.kv_heads, d), v.view(n, self.kv_heads, d)

    def _qkv_rotary_cuda(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                         fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """qkv, the q/k norms (Qwen3), the rotary and the KV cache write by fused Triton kernels:
        (q and k heads rotated, v heads, whether k and v are in the KV cache already)."""
        from rollout.layers import triton_ops
        if self.q_norm is None and (fused := self._fused_qkv_rope(rope, x, fb)) is not None:
            return *self._heads(fused), True
        # split-K partials of qkv are summed by the rotary kernel (and normed there, Qwen3)
        qkv = self.qkv_proj(x, defer_split=self.q_norm is None or triton_ops.FUSED_QK_NORM)
        return self._rotary_cuda(rope, qkv, fb)

    def _rotary_cuda(self, rope: tuple[torch.Tensor, torch.Tensor],
                     qkv: Union[torch.Tensor, SplitSum],
                     fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The q/k norms (Qwen3), the rotary and the KV cache write of qkv (or of its split-K
        partials) by fused Triton kernels: as `_qkv_rotary_cuda`."""
        from rollout.layers import triton_ops
        fuse_norm = self.q_norm is not None and triton_ops.FUSED_QK_NORM
        split = qkv if isinstance(qkv, SplitSum) else None
        qk, v = self._heads(split.out if split is not None else qkv)  # the rotary kernel writes
        if self.q_norm is not None and not fuse_norm:
            for heads, norm in zip(qk.split([self.heads, self.kv_heads], dim=1),
                                   (self.q_norm, self.k_norm)):
                triton_ops.rms_norm(heads, norm.weight, norm.eps, out=heads)
        # the q/k norms, rotary and the KV cache write in one kernel where the pool allows it
        target = fb.token_to_kv_pool.rotary_store_target(self.attn.layer_id, fb.out_cache_loc, v)
        triton_ops.apply_rotary_inplace(
            qk, *rope, kv=triton_ops.KVStore(*target) if target is not None else None,
            source=split, qk_norm=triton_ops.QKNorm(self.q_norm.weight, self.k_norm.weight,
                                                    self.q_norm.eps, self.heads)
            if fuse_norm else None)
        return qk, v, target is not None

    def _fused_qkv_rope(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                        fb: ForwardBatch) -> Optional[torch.Tensor]:
        """At one row: qkv, the rotary and the KV cache write in one kernel (triton_qkv_rope),
        where the plain qkv GEMV would be the FMA kernel and the pool takes a fused store; else
        None."""
        w = self.qkv_proj.weight
        if not use_skinny(x, w):
            return None
        from rollout.layers import triton_qkv_rope
        heads = triton_qkv_rope.QKVHeads(self.heads, self.kv_heads, self.attn.head_dim)
        cfg = triton_qkv_rope.fused_config(x, w, heads)
        if cfg is None:
            return None
        out, kv = self._qkv_out_and_store(x.shape[0], x, fb)
        if kv is None:
            return None
        return triton_qkv_rope.qkv_rope(x, w, self.qkv_proj.bias, *rope, heads, kv, cfg, out)

    def _qkv_out_and_store(self, rows: int, like: torch.Tensor, fb: ForwardBatch) -> tuple:
        """(a qkv output for `rows`, the KV store a fused kernel writes its keys and values
        through — None where the pool takes no fused store)."""
        out = torch.empty(rows, self.qkv_proj.weight.shape[0], dtype=like.dtype,
                          device=like.device)
        target = fb.token_to_kv_pool.rotary_store_target(self.attn.layer_id, fb.out_cache_loc,
                                                         self._heads(out)[1])
        from rollout.layers.triton_ops import KVStore
        return out, KVStore(*target) if target is not None else None

    def _fused_norm_qkv_rope(self, rope: tuple[torch.Tensor, torch.Tensor],
                             h: Union[torch.Tensor, SplitSum], residual: torch.Tensor,
                             norm: RMSNorm, fb: ForwardBatch
                             ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(qkv rotated, new residual) from triton_norm_qkv_rope where it takes this row (and
        the one-row qkv + rotary kernel would run: no q/k norm, the pool takes a fused store),
        else None."""
        taken = self._norm_qkv_takes(h, residual, norm, qk_norm=False)
        if taken is None:
            return None
        w, heads = taken
        from rollout.layers import triton_norm_qkv_rope as fused, triton_qkv_rope
        if triton_qkv_rope.fused_config(residual, w, heads) is None:
            return None
        out, kv = self._qkv_out_and_store(1, residual, fb)
        if kv is None:
            return None
        return out, fused.norm_qkv_rope(h, residual, norm.weight, norm.eps, w, self.qkv_proj.bias,
                                        *rope, heads, kv, out, fused.CONFIG)

    def _fused_norm_qkv(self, h: Union[torch.Tensor, SplitSum], residual: torch.Tensor,
                        norm: RMSNorm) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(qkv, new residual) from triton_norm_qkv_rope's kernel without its rotary where it
        takes this row and qkv has q/k norms (Qwen3: they come before the rotary, in the rotary
        kernel after this one) and the plain qkv GEMV would be the one-row FMA kernel, else
        None."""
        taken = self._norm_qkv_takes(h, residual, norm, qk_norm=True)
        if taken is None:
            return None
        w, heads = taken
        from rollout.layers import triton_gemv, triton_norm_qkv_rope as fused
        if triton_gemv._config(1, *w.shape).dot:
            return None
        out = torch.empty(1, w.shape[0], dtype=residual.dtype, device=residual.device)
        return out, fused.norm_qkv(h, residual, norm.weight, norm.eps, w, self.qkv_proj.bias,
                                   heads, out, fused.CONFIG)

    def _norm_qkv_takes(self, h: Union[torch.Tensor, SplitSum], residual: torch.Tensor,
                        norm: RMSNorm, qk_norm: bool) -> Optional[tuple[torch.Tensor, Any]]:
        """(qkv weight, heads) where triton_norm_qkv_rope's kernel takes this row: one CUDA row
        the skinny GEMV serves, with or without q/k norms as `qk_norm` says; else None."""
        w = self.qkv_proj.weight
        if not (residual.is_cuda and (self.q_norm is not None) == qk_norm
                and use_skinny(residual, w)):
            return None
        from rollout.layers import triton_norm_qkv_rope as fused, triton_qkv_rope
        heads = triton_qkv_rope.QKVHeads(self.heads, self.kv_heads, self.attn.head_dim)
        if not fused.applies(h, residual, norm.weight, w, heads, fused.CONFIG):
            return None
        return w, heads

    def _qkv_rotary_cpu(self, rope: tuple[torch.Tensor, torch.Tensor],
                        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        qk, v = self._heads(self.qkv_proj(x))
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.heads]), self.k_norm(qk[:, self.heads:])),
                           dim=1)
        apply_rotary_full_(qk, *rope)  # q and k heads together, in place: one rotation per layer
        return qk, v, False


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, SplitSum]:
        """On CUDA the output may be down's split-K partials, summed by the next RMSNorm."""
        if x.is_cuda:
            return self.down_proj(self.activation_cuda(x), defer_split=True)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(nn.functional.silu(gate).mul_(up))

    def activation_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up on CUDA: the fused skinny kernel where it serves, else cuBLAS + SiLU."""
        w = self.gate_up_proj.weight
        if self.gate_up_proj.bias is None and use_skinny(x, w, gated=True):  # one kernel
            from rollout.layers import triton_gemv
            return triton_gemv.skinny_gate_up_silu(x, w, self.inter)
        from rollout.layers import triton_ops
        return triton_ops.silu_and_mul(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, qk_norm: bool,
                 packed: PackedWeights):
        super().__init__()
        self.packed = packed  # the model's cache of packed CPU weights (not a submodule)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, layer_id, tp, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sparse = cfg.moe is not None and layer_id in cfg.moe.sparse_layers
        self.mlp = (SparseMoE(cfg.moe, cfg.hidden_size, tp,
                              record_index=sorted(cfg.moe.sparse_layers).index(layer_id))
                    if self.sparse else MLP(cfg, tp))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: Union[torch.Tensor, SplitSum],
                residual: Optional[torch.Tensor],
                fb: ForwardBatch) -> tuple[Union[torch.Tensor, SplitSum], torch.Tensor]:
        """SGLang's residual stream: returns (mlp output, residual) and each norm adds the
        pending branch output to the residual first (one fused kernel on CUDA; the mlp output
        may still be split-K partials, which that kernel sums). The first layer gets
        residual=None. The same sums as `h = h + attn(norm(h)); h = h + mlp(norm(h))`."""
        if residual is None:
            # the first norm lets its successor launch only after its PDL wait: the kernels after
            # it load the step's rotary rows before their own wait, and the embedding kernel
            # before it writes them (triggered early, the qkv kernel could read them first)
            with pdl_policy.decode_forward(False):
                normed = self.input_layernorm(h)
            residual, h = h, normed
            h = self.self_attn(rope, h, fb)
        else:
            h, residual = self.self_attn.forward_normed(rope, h, residual, self.input_layernorm,
                                                        fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return (self.mlp(h, fb) if self.sparse else self.mlp(h)), residual

    def forward_cpu(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor,
                    residual: Optional[torch.Tensor],
                    fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on CPU tensors, op for op the same torch calls as the modules' CPU branches,
        written flat: at batch 1 a step is bound by per-call host overhead, and the ~10 module
        calls and ~25 module attribute lookups per layer cost more than its elementwise math."""
        (in_w, post_w, eps, qkv_w, qkv_b, o_w, gu_w, down_w, q_norm, k_norm, attn, heads, kv_heads,
         head_dim, qk_size, kv_size, inter, tp) = self._cpu_refs()
        if residual is None:
            residual, x = h, rms_norm_ref(h, in_w, eps)
        else:
            residual = h + residual
            x = rms_norm_ref(residual, in_w, eps)
        n, packed = x.shape[0], self.packed
        qkv = cpu_linear(x, qkv_w, qkv_b, packed(qkv_w))
        qk, v = qkv[:, :qk_size], qkv[:, qk_size:]  # slices: Tensor.split costs more in Python
        qk = qk.view(n, heads + kv_heads, head_dim)
        if q_norm is not None:
            qk = torch.cat((q_norm(qk[:, :heads]), k_norm(qk[:, heads:])), dim=1)
        apply_rotary_full_(qk, *rope)
        q, k = qk[:, :heads], qk[:, heads:]
        out = fb.attn_backend.forward(q, k, v.view(n, kv_heads, head_dim), attn, fb)
        h = _row_linear(out.reshape(n, heads * head_dim), o_w, packed(o_w), tp,
                        self.self_attn.o_proj.bias)
        residual = h + residual
        x = rms_norm_ref(residual, post_w, eps)
        if gu_w is None:  # a sparse MoE MLP
            return self.mlp(x, fb), residual
        if (array := ONE_ROW_BLAS.array_for(x, gu_w)) is not None:
            act = _silu_mul(ONE_ROW_BLAS.gemv(x, array), inter)
        elif (halves := packed.halves(gu_w, inter)) is not None:
            act = cpu_gate_up_silu(x, *halves)
        else:
            act = _silu_mul(cpu_linear(x, gu_w, None, packed(gu_w)), inter)
        return _row_linear(act, down_w, packed(down_w), tp, self.mlp.down_proj.bias), residual

    def _cpu_refs(self) -> tuple:
        """The tensors and sizes `forward_cpu` reads, looked up once. Parameters are updated in
        place (weight loading and sync copy into them), so references to them stay valid."""
        refs = self.__dict__.get("_refs")
        if refs is None:
            a, m = self.self_attn, self.mlp
            assert self.input_layernorm.eps == self.post_attention_layernorm.eps
            dense = (None, None, None) if self.sparse \
                else (m.gate_up_proj.weight, m.down_proj.weight, m.inter)  # sparse: its module
            refs = (self.input_layernorm.weight, self.post_attention_layernorm.weight,
                    self.input_layernorm.eps, a.qkv_proj.weight, a.qkv_proj.bias, a.o_proj.weight,
                    *dense[:2], a.q_norm, a.k_norm, a.attn, a.heads,
                    a.kv_heads, a.attn.head_dim, a.qkv_proj.q_size + a.qkv_proj.kv_size,
                    a.qkv_proj.kv_size, dense[2], a.o_proj.tp)
            self.__dict__["_refs"] = refs  # a plain attribute: not a parameter, not in state_dict
        return refs


def _silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    return nn.functional.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])


def _row_linear(x: torch.Tensor, weight: torch.Tensor, packed: Optional[torch.Tensor], tp: TPGroup,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """RowParallelLinear.forward on CPU."""
    out = tp.all_reduce(cpu_linear(x, weight, None, packed))
    return out if bias is None else out + bias


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, qk_norm: bool, packed: PackedWeights):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp, qk_norm, packed) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        residual = None
        # the rotary rows once per step, shared by every layer: half tables for the CUDA
        # kernels, full on CPU
        if input_ids.is_cuda:
            h, rope = self._embed_and_rope_cuda(input_ids, positions)
            for layer in self.layers:
                h, residual = layer(rope, h, residual, fb)
        else:
            h = self.embed_tokens(input_ids)
            rope = self.rotary.lookup_full(positions, h.dtype)
            for layer in self.layers:
                h, residual = layer.forward_cpu(rope, h, residual, fb)
        return self.norm(h, residual)[0]

    def _embed_and_rope_cuda(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """(embeddings, (cos, sin)): one Triton kernel unsharded (`triton_embed`), else the
        vocab-parallel embedding and the table's gather."""
        weight = self.embed_tokens.weight
        from rollout.layers import triton_embed
        if self.embed_tokens.tp.size == 1 and triton_embed.FUSED_EMBED_ROPE:
            return triton_embed.embed_and_rope(input_ids, positions, weight,
                                               self.rotary.half_table(weight.dtype))
        return self.embed_tokens(input_ids), self.rotary.lookup(positions, weight.dtype)


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # HF tensors fused into one of our parameters: fused name → (HF name, shard id) pieces.
    packed_modules = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = cfg
        # oneDNN-packed CPU weights: enabled by the ModelRunner (EngineConfig.cpu_packed_weights),
        # emptied by `load_weights` here and by every other path that writes weights
        self.packed_weights = PackedWeights()
        self.model = DecoderModel(cfg, tp, self.qk_norm, self.packed_weights)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._table = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Logits float32 (see `head_logits`)."""
        return self.head_logits(hidden, fb).float()

    def head_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Logits as the LM head computes them, in the model's dtype: the rows `fb` asks for."""
        rows = fb.logits_indices()
        if rows is not None:
            hidden = hidden[rows]
        return self.lm_head.compute_logits(hidden, self.packed_weights(self.lm_head.weight))

    @property
    def weight_table(self) -> WeightTable:
        if self._table is None:
            aliases = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
            self._table = WeightTable.build(self, self.packed_modules, ignored=aliases)
        return self._table

    def load_weights(self, weights) -> int:
        """The one loading path (checkpoints and weight sync): HF-named full tensors are
        validated against the parameter table, then copied in place into this rank's shards."""
        try:
            return self.weight_table.load(weights)
        finally:
            self.packed_weights.clear()


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's decoder under Mistral's name (sliding windows are refused by ModelConfig)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with bias on q/k/v (from config.attention_bias, true for Qwen2)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before rope."""

    qk_norm = True
