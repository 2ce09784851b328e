"""Reference attention in plain PyTorch: the batch is padded to [batch, max_len] and served by
one scaled_dot_product_attention call per layer (no loop over requests)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rollout.attention.base import AttentionBackend

if TYPE_CHECKING:
    from rollout.forward_batch import ForwardBatch
    from rollout.layers.attention import Attention


@dataclass
class PaddedMetadata:
    kv_slots: torch.Tensor  # [B, L] KV slot per (request, key position); padding → slot 0
    mask: torch.Tensor  # [B, 1, Q, L] True where query may attend key
    token_batch: torch.Tensor  # [T] request of each flat new token
    token_offset: torch.Tensor  # [T] its index among that request's new tokens
    max_q: int


class TorchNativeBackend(AttentionBackend):
    def __init__(self, runner) -> None:
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.meta: PaddedMetadata | None = None

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        dev = fb.input_ids.device
        max_len, max_q = fb.max_seq_len, fb.max_extend_len
        key_pos = torch.arange(max_len, device=dev)
        seq_lens = fb.seq_lens.view(-1, 1)
        kv_valid = key_pos.view(1, -1) < seq_lens  # [B, L]
        slots = self.req_to_token[fb.req_pool_indices, :max_len].long().masked_fill(~kv_valid, 0)
        ext = torch.tensor(fb.extend_seq_lens_cpu, device=dev)
        q_pos = (seq_lens - ext.view(-1, 1)) + torch.arange(max_q, device=dev).view(1, -1)  # [B, Q]
        mask = (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)
        token_batch = torch.repeat_interleave(torch.arange(fb.batch_size, device=dev), ext)
        starts = torch.cumsum(ext, 0) - ext
        token_offset = torch.arange(int(ext.sum()), device=dev) - starts[token_batch]
        self.meta = PaddedMetadata(slots, mask.unsqueeze(1), token_batch, token_offset, max_q)

    def forward_extend(self, q, layer, fb):
        m = self.meta
        padded = q.new_zeros(fb.batch_size, m.max_q, *q.shape[1:])
        padded[m.token_batch, m.token_offset] = q
        out = self._attend(padded, layer, fb)  # [B, Q, H, D]
        return out[m.token_batch, m.token_offset]

    def forward_decode(self, q, layer, fb):
        return self._attend(q.unsqueeze(1), layer, fb).squeeze(1)

    def _attend(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        pool, m = fb.token_to_kv_pool, self.meta
        k = pool.k_buffers[layer.layer_id][m.kv_slots].to(q.dtype)  # [B, L, Hkv, D]
        v = pool.v_buffers[layer.layer_id][m.kv_slots].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m.mask,
            scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out.transpose(1, 2)
