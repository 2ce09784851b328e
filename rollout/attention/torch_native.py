"""Reference attention in plain PyTorch: the batch is padded to [batch, max_len] and served by
one scaled_dot_product_attention call per layer (no loop over requests).

Per step the metadata is built once: the KV slot of every (request, key position), flattened so
each layer gathers its keys and values with one `index_select` each (advanced indexing with a
2-D index is several times slower on CPU), and a mask only where one is needed. A decode step
whose requests all hold the same number of keys (always so at batch 1) needs no mask at all;
otherwise padded keys read the dummy slot 0 and are masked out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from rollout.attention.base import AttentionBackend
from rollout.attention.kv_mirror import DecodeKVMirror

if TYPE_CHECKING:
    from rollout.forward_batch import ForwardBatch
    from rollout.layers.attention import Attention


@dataclass
class PaddedMetadata:
    kv_slots: torch.Tensor  # [B * L] KV slot per (request, key position), flat; padding → slot 0
    mask: Optional[torch.Tensor]  # [B, 1, Q, L] True where query may attend key; None: all keys
    token_batch: Optional[torch.Tensor]  # [T] request of each flat new token (extend only)
    token_offset: Optional[torch.Tensor]  # [T] its index among that request's new tokens
    batch: int
    max_len: int
    max_q: int


# From this many requests a decode step uses `_decode_matmul` instead of SDPA (measured on CPU:
# equal at batch 16, SDPA ~1.8x slower at batch 64 with 96 keys).
DECODE_MATMUL_MIN_BATCH = 16


class TorchNativeBackend(AttentionBackend):
    def __init__(self, runner) -> None:
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.meta: PaddedMetadata | None = None
        # CPU only: K/V gathers land in two buffers reused by every layer and step (a fresh
        # multi-MB tensor per gather costs more in page faults than the gather itself), and
        # the block-diagonal query of `_decode_matmul_cpu`, zero off its diagonal blocks
        self._gather_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._qexp: torch.Tensor | None = None
        # CPU decode from DECODE_MATMUL_MIN_BATCH requests: the batch's K/V kept dense across
        # steps (appended, not gathered, while the batch stays the same)
        self.kv_mirror = DecodeKVMirror()

    def _gather_kv(self, kb: torch.Tensor, vb: torch.Tensor, slots: torch.Tensor):
        """CPU: K and V rows of `slots`, gathered into the reused buffers (views of them; valid
        until the next layer's gather)."""
        n = slots.shape[0]
        bufs = self._gather_bufs
        if (bufs is None or bufs[0].shape[0] < n or bufs[0].shape[1:] != kb.shape[1:]
                or bufs[0].dtype != kb.dtype or bufs[1].shape[1:] != vb.shape[1:]
                or bufs[1].dtype != vb.dtype):
            rows = max(n, bufs[0].shape[0] if bufs is not None else 0)
            bufs = self._gather_bufs = (kb.new_empty((rows, *kb.shape[1:])),
                                        vb.new_empty((rows, *vb.shape[1:])))
        return (torch.index_select(kb, 0, slots, out=bufs[0][:n]),
                torch.index_select(vb, 0, slots, out=bufs[1][:n]))

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if fb.forward_mode.is_decode:
            self.meta = self._decode_metadata(fb)
            self._plan_mirror(fb)
        else:
            self.meta = self._extend_metadata(fb)
            self.kv_mirror.reset()

    def _plan_mirror(self, fb: "ForwardBatch") -> None:
        """A CPU decode step served by `_decode_mirror` appends to the mirror or rebuilds it;
        any other step leaves it stale, so it is reset."""
        pool = fb.token_to_kv_pool
        kb = pool.k_buffers[0]
        if (kb.device.type != "cpu" or fb.batch_size < DECODE_MATMUL_MIN_BATCH
                or kb.dtype != pool.v_buffers[0].dtype
                or not self.kv_mirror.plan(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, kb,
                                           len(pool.k_buffers))):
            self.kv_mirror.reset()

    def _decode_metadata(self, fb: "ForwardBatch") -> PaddedMetadata:
        lens, bs = fb.seq_lens_cpu, fb.batch_size
        max_len = max(lens)
        # cut to max_len before the gather: copies only the keys' columns of each row
        slots = self.req_to_token[:, :max_len].index_select(0, fb.req_pool_indices)
        mask = None
        if bs > 1 and min(lens) != max_len:  # ragged: padded keys read slot 0 and are masked out
            valid = torch.arange(max_len, device=slots.device).view(1, -1) < fb.seq_lens.view(-1, 1)
            slots = slots.masked_fill(~valid, 0)
            mask = valid.view(bs, 1, 1, max_len)
        return PaddedMetadata(slots.reshape(-1), mask, None, None, bs, max_len, 1)

    def _extend_metadata(self, fb: "ForwardBatch") -> PaddedMetadata:
        dev = fb.input_ids.device
        max_len, max_q = fb.max_seq_len, fb.max_extend_len
        key_pos = torch.arange(max_len, device=dev)
        seq_lens = fb.seq_lens.view(-1, 1)
        kv_valid = key_pos.view(1, -1) < seq_lens  # [B, L]
        slots = self.req_to_token.index_select(0, fb.req_pool_indices)[:, :max_len]
        slots = slots.masked_fill(~kv_valid, 0)
        ext = torch.tensor(fb.extend_seq_lens_cpu, device=dev)
        q_pos = (seq_lens - ext.view(-1, 1)) + torch.arange(max_q, device=dev).view(1, -1)  # [B, Q]
        mask = (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)
        token_batch = torch.repeat_interleave(torch.arange(fb.batch_size, device=dev), ext)
        starts = torch.cumsum(ext, 0) - ext
        token_offset = torch.arange(fb.num_tokens, device=dev) - starts[token_batch]
        return PaddedMetadata(slots.reshape(-1), mask.unsqueeze(1), token_batch, token_offset,
                              fb.batch_size, max_len, max_q)

    def forward(self, q, k, v, layer, fb, kv_stored: bool = False):
        pool = fb.token_to_kv_pool
        kb, vb = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        if kb.device.type == "cpu" and k.dtype == kb.dtype and v.dtype == vb.dtype:
            if not kv_stored:
                kb.index_copy_(0, fb.out_cache_loc, k)  # what set_kv writes, one call each
                vb.index_copy_(0, fb.out_cache_loc, v)
            if self.kv_mirror.planned and q.dtype == kb.dtype:
                keys, values = self.kv_mirror.update(layer.layer_id, k, v, kb, vb, self.meta.kv_slots)
                return self._decode_mirror(q, keys, values, layer)
        elif not kv_stored:
            pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        if fb.forward_mode.is_decode:
            return self.forward_decode(q, layer, fb)
        return self.forward_extend(q, layer, fb)

    def forward_extend(self, q, layer, fb):
        m = self.meta
        padded = q.new_zeros(fb.batch_size, m.max_q, *q.shape[1:])
        padded[m.token_batch, m.token_offset] = q
        out = self._attend(padded, layer, fb)  # [B, Q, H, D]
        return out[m.token_batch, m.token_offset]

    def forward_decode(self, q, layer, fb):
        if q.shape[0] >= DECODE_MATMUL_MIN_BATCH:
            if q.device.type == "cpu":
                pool = fb.token_to_kv_pool
                if pool.k_buffers[layer.layer_id].dtype == q.dtype == pool.v_buffers[layer.layer_id].dtype:
                    return self._decode_matmul_cpu(q, layer, fb)
            self.kv_mirror.reset()  # this step's tokens miss the mirror
            return self._decode_matmul(q, layer, fb)
        # q [B, H, D] → [B, H, 1, D] is a view; the output comes back as [B, H, 1, D]
        return self._attend_hq(q.unsqueeze(2), layer, fb).reshape(q.shape)

    def _decode_mirror(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: "Attention") -> torch.Tensor:
        """Decode attention over the mirror's head-major K/V: each KV head's GQA group of query
        rows against its keys in one `bmm` (scores [B * Hkv, G, L]), softmax, · V; the output
        [B * Hkv, G, D] is already [B, H, D] in memory. k [B * Hkv, D, L] (keys transposed),
        v [B * Hkv, L, D]: `DecodeKVMirror.update`'s views."""
        m = self.meta
        bs, heads, dim = q.shape
        kv_heads = k.shape[0] // bs
        scores = torch.bmm(q.reshape(bs * kv_heads, heads // kv_heads, dim), k)
        scores.mul_(layer.scaling)
        if m.mask is not None:
            scores.view(bs, kv_heads, -1, m.max_len).masked_fill_(
                m.mask.view(bs, 1, 1, m.max_len).logical_not(), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.bmm(probs, v).view(bs, heads, dim)

    def _decode_matmul(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        """Decode attention as two batched matmuls, the GQA group of each KV head in one:
        scores [B, Hkv, G, L] = q [B, Hkv, G, D] · Kᵀ, softmax, · V. SDPA's CPU kernel with one
        query row per request costs about twice as much from a few requests up."""
        pool, m = fb.token_to_kv_pool, self.meta
        kb, vb = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        bs, heads, dim = q.shape
        kv_heads = kb.shape[1]
        shape = (bs, m.max_len, kv_heads, dim)
        k = kb.index_select(0, m.kv_slots).view(shape)
        v = vb.index_select(0, m.kv_slots).view(shape)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        scores = torch.matmul(q.view(bs, kv_heads, heads // kv_heads, dim), k.permute(0, 2, 3, 1))
        scores.mul_(layer.scaling)
        if m.mask is not None:
            scores.masked_fill_(m.mask.logical_not(), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v.transpose(1, 2)).view(bs, heads, dim)

    def _decode_matmul_cpu(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        """`_decode_matmul` on CPU without copying K or V. A gathered K row [Hkv * D] holds all
        KV heads; scores [B, H, L] = Q' · Kᵀ where Q' [B, H, Hkv * D] carries each query head in
        its KV head's block and zeros elsewhere (the zero products add exact zeros), so Kᵀ is a
        transposed view that bmm reads in place. P · V [B, H, Hkv * D] then holds each head's
        output in its KV head's block: the diagonal blocks are the result. The permutes that
        `_decode_matmul` feeds to matmul copy K and V ([B, L, Hkv, D] each) every layer; here
        the extra multiply-adds (Hkv× on tiny matrices) cost less."""
        pool, m = fb.token_to_kv_pool, self.meta
        kb, vb = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        bs, heads, dim = q.shape
        kv_heads = kb.shape[1]
        group, width = heads // kv_heads, kv_heads * dim
        k, v = self._gather_kv(kb, vb, m.kv_slots)
        k, v = k.view(bs, m.max_len, width), v.view(bs, m.max_len, width)
        qexp = self._qexp
        if qexp is None or qexp.shape != (bs, heads, width) or qexp.dtype != q.dtype:
            qexp = self._qexp = q.new_zeros((bs, heads, width))
        # only the diagonal blocks are ever written: the rest stays zero
        qexp.view(bs, kv_heads, group, kv_heads, dim).diagonal(dim1=1, dim2=3).copy_(
            q.view(bs, kv_heads, group, dim).permute(0, 2, 3, 1))
        scores = torch.bmm(qexp, k.transpose(1, 2))  # [B, H, L]
        scores.mul_(layer.scaling)
        if m.mask is not None:
            scores.masked_fill_(m.mask.view(bs, 1, m.max_len).logical_not(), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, v).view(bs, kv_heads, group, kv_heads, dim)
        return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(bs, heads, dim)

    def _attend(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        """q [B, Q, H, D] → [B, Q, H, D]."""
        return self._attend_hq(q.transpose(1, 2), layer, fb).transpose(1, 2)

    def _attend_hq(self, q: torch.Tensor, layer: "Attention", fb: "ForwardBatch") -> torch.Tensor:
        """q [B, H, Q, D] → [B, H, Q, D]: one gather of the keys and one of the values."""
        pool, m = fb.token_to_kv_pool, self.meta
        kb, vb = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        shape = (m.batch, m.max_len, *kb.shape[1:])  # [B, L, kv heads, head_dim]
        if kb.device.type == "cpu":
            k, v = self._gather_kv(kb, vb, m.kv_slots)
            k, v = k.view(shape), v.view(shape)
        else:
            k = kb.index_select(0, m.kv_slots).view(shape)
            v = vb.index_select(0, m.kv_slots).view(shape)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        return F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m.mask,
            scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads)
