"""The decode benchmark with one op of every decoder layer (or the LM head) taken out of the
model: where a decode step's time goes when its kernels overlap.

Under programmatic dependent launch a kernel's blocks wait for their predecessor while already
resident, so per-kernel profiler times overlap and no longer add up to the step; what an op
costs the step is the step's time with the op minus without it. ROLLOUT_ABLATE names the op;
its output is replaced by a view of a buffer allocated before the engine starts (zeros: the
numbers stay finite, and the step launches no kernel in the op's place). The engine's results
are then wrong by construction; only the timings mean anything. Run through engine_ab.py (the
"script" key of a variant, benchmarks/ab_fifteenth_session_ablation.json):

  ROLLOUT_ABLATE=attention python benchmarks/decode_ablated.py --shape qwen2-1.5b --device cuda \
      --dtype bfloat16 --batch-sizes 1 --skip-hf --out $OUT/x.json

Ops: input_norm, post_norm (the residual add + RMSNorm before attention / before the MLP: the
hidden state becomes the residual itself), qkv (the qkv GEMV with the rotary and the KV store:
q, k, v become zeros, nothing is written to the KV cache), attention (the decode attention
kernels: the output becomes zeros), attention_merge (the split-KV merge kernel only: the output
becomes zeros, the split kernel still runs), o, gate_up (with its SiLU), down, lm_head; "none" ablates
nothing (the baseline, through the same wrapper)."""
from __future__ import annotations

import os
import sys

import torch

ROWS = 8448  # a prefill chunk (8,192 tokens) and more: every forward's rows fit the buffers
OPS = ("none", "input_norm", "post_norm", "qkv", "attention", "attention_merge", "o", "gate_up",
       "down", "lm_head")


def _zeros(cols: int, rows: int = ROWS) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.bfloat16, device="cuda")


def apply(op: str) -> None:
    """Patch the model classes so that `op` runs no kernel (see the module docstring)."""
    from rollout.models import llama
    if op not in OPS:
        raise SystemExit(f"ROLLOUT_ABLATE={op!r}: one of {', '.join(OPS)}")
    if op in ("input_norm", "post_norm"):
        _ablate_norm(llama, op)
    elif op in ("qkv", "attention", "o"):
        _ablate_attention_part(llama, op)
    elif op == "attention_merge":
        _ablate_attention_merge()
    elif op in ("gate_up", "down"):
        _ablate_mlp_part(llama, op)
    elif op == "lm_head":
        logits = _zeros(151936, 512)
        llama.LlamaForCausalLM.head_logits = (
            lambda self, hidden, fb: logits[:_logit_rows(hidden, fb), :self.config.vocab_size])


def _logit_rows(hidden: torch.Tensor, fb) -> int:
    rows = fb.logits_indices()
    return hidden.shape[0] if rows is None else rows.shape[0]


def _ablate_norm(llama, op: str) -> None:
    def forward(self, rope, h, residual, fb):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        elif op == "input_norm":
            h = residual
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(rope, h, fb)
        if op == "post_norm":
            h = residual
        else:
            h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual
    llama.DecoderLayer.forward = forward


def _ablate_attention_part(llama, op: str) -> None:
    qkv_zeros, attn_zeros = _zeros(4096), _zeros(4096)
    real_qkv = llama.DecoderAttention._qkv_rotary_cuda

    def forward(self, rope, x, fb):
        n, d = x.shape[0], self.attn.head_dim
        if op == "qkv":
            qk, v = self._heads(qkv_zeros[:n, :self.qkv_proj.weight.shape[0]])
            kv_stored = True
        else:
            qk, v, kv_stored = real_qkv(self, rope, x, fb)
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        if op == "attention":
            out = attn_zeros[:n, :self.heads * d]
        else:
            out = self.attn(q, k, v, fb, kv_stored)
        if op == "o":
            return out
        with llama.pdl_policy.preloaders_early():
            return self.o_proj(out, defer_split=True)
    llama.DecoderAttention.forward = forward


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _ablate_attention_merge() -> None:
    from rollout.attention import triton_backend
    from rollout.attention.triton_kernels import decode
    decode._decode_reduce_kernel = _NoLaunch()
    zeros, real = _zeros(4096), triton_backend.decode_attention

    def decode_attention(q, *args, **kwargs):  # into zeros: finite logits, valid tokens
        return real(q, *args, out=zeros.view(-1)[:q.numel()].view(q.shape), **kwargs)
    triton_backend.decode_attention = decode_attention


def _ablate_mlp_part(llama, op: str) -> None:
    act_zeros, out_zeros = _zeros(8960), _zeros(1536)

    def forward(self, x):
        n = x.shape[0]
        if op == "down":
            self.activation_cuda(x)
            return out_zeros[:n, :self.down_proj.weight.shape[0]]
        return self.down_proj(act_zeros[:n, :self.inter], defer_split=True)
    llama.MLP.forward = forward


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    apply(os.environ.get("ROLLOUT_ABLATE", "none"))
    from benchmarks import decode_throughput
    decode_throughput.main()
