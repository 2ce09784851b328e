"""The attention op of one layer: a handle that the backend serves (SGLang's RadixAttention)."""
from __future__ import annotations

import torch
from torch import nn

from rollout.forward_batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                kv_stored: bool = False) -> torch.Tensor:
        """q/k/v: [tokens, heads, head_dim] → [tokens, heads * head_dim]. `kv_stored`: k and v
        are already in the KV pool (written by the rotary kernel)."""
        out = fb.attn_backend.forward(q, k, v, self, fb, kv_stored)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
