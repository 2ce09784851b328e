"""CPU decode: the running batch's keys and values kept dense between steps.

The paged pool holds each token's K and V at a slot of its own, so attention over it starts
with a gather of every cached key of the batch, each layer and step: at 64 requests that copy
cost as much as the attention matmuls. Decode batches, though, repeat: the same requests in the
same order, each one token longer. `DecodeKVMirror` keeps, per layer, the batch's keys as
[batch, kv_heads, head_dim, capacity] and values as [batch, kv_heads, capacity, head_dim]
(head-major, so each KV head's keys are one matrix for `bmm`; the keys already transposed,
because a score `bmm` that reads Kᵀ in place is ~30% slower here when K comes from memory, as
it does inside a decode step) and on such a step writes just the new token of each request;
any other step gathers the whole batch from the pool again. The pool stays the owner of the KV:
the mirror is a copy derived from it, rebuilt whenever it cannot prove it is current (an extend
step, a change of requests or order, a length that is not the last one plus one, a pool
reallocated)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Mirrors larger than this (all layers, K and V) are not kept: attention gathers as before.
MAX_MIRROR_BYTES = 64 << 20
# Positions allocated at a rebuild: the longest request's, plus a quarter and 16 more, rounded up
# to 16, so that the next steps append (few for short requests, whose rebuilds are cheap).
def capacity(max_len: int) -> int:
    return -(-(max_len + max_len // 4 + 16) // 16) * 16


@dataclass
class _StepPlan:
    rebuild: bool  # gather the whole batch from the pool (else: append the new token)
    batch: int
    max_len: int
    append_rows: Optional[torch.Tensor]  # [batch * kv_heads] rows of the flat V mirror to write
    append_keys: Optional[torch.Tensor]  # [batch * kv_heads * head_dim] elements of the flat K mirror


class DecodeKVMirror:
    def __init__(self) -> None:
        self._k: list[Optional[torch.Tensor]] = []
        self._v: list[Optional[torch.Tensor]] = []
        self._rows: Optional[list[int]] = None  # request rows of the last mirrored step, in order
        self._lens: list[int] = []
        self._pool_ptr = 0
        self._plan: Optional[_StepPlan] = None
        self.appended_steps = 0  # decode steps served by appending (the rest rebuilt): stats
        self.rebuilt_steps = 0

    def reset(self) -> None:
        """Forget the batch (the buffers are kept for reuse): the next step rebuilds."""
        self._rows, self._plan = None, None

    def plan(self, rows: list[int], lens: list[int], k_buffer: torch.Tensor, num_layers: int) -> bool:
        """Decide, once per decode step, whether this step appends or rebuilds. False (and the
        mirror reset) when the mirror would exceed MAX_MIRROR_BYTES: the caller gathers."""
        batch, max_len = len(rows), max(lens)
        kv_heads, head_dim = k_buffer.shape[1:]
        if (2 * num_layers * batch * kv_heads * capacity(max_len) * head_dim
                * k_buffer.element_size() > MAX_MIRROR_BYTES):
            self.reset()
            return False
        current = self._k[0] if self._k else None
        append = (self._rows == rows and current is not None
                  and self._pool_ptr == k_buffer.data_ptr() and max_len <= current.shape[3]
                  and all(n == p + 1 for n, p in zip(lens, self._lens)))
        if append:
            cap = current.shape[3]
            last = torch.tensor(lens).sub_(1)
            value_rows = torch.arange(batch * kv_heads).mul_(cap).view(batch, -1)
            key_elems = torch.arange(batch * kv_heads * head_dim).mul_(cap).view(batch, -1)
            last = last.view(batch, 1)
            self._plan = _StepPlan(False, batch, max_len, value_rows.add_(last).view(-1),
                                   key_elems.add_(last).view(-1))
            self.appended_steps += 1
        else:
            if not self._ensure_buffers(num_layers, batch, max_len, k_buffer):
                self.reset()
                return False
            self._plan = _StepPlan(True, batch, max_len, None, None)
            self.rebuilt_steps += 1
        self._rows, self._lens, self._pool_ptr = list(rows), list(lens), k_buffer.data_ptr()
        return True

    @property
    def planned(self) -> bool:
        return self._plan is not None

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor,
               v_buffer: torch.Tensor, kv_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys as [batch * kv_heads, head_dim, max_len] and values as
        [batch * kv_heads, max_len, head_dim] (views), after the step's k, v [batch, kv_heads,
        head_dim] were written to the pool. `kv_slots`: the pool slot of every (request, key
        position), [batch * max_len], padding at slot 0."""
        p = self._plan
        mk, mv = self._k[layer_id][:p.batch], self._v[layer_id][:p.batch]
        kv_heads, head_dim = mv.shape[1], mv.shape[3]
        if p.rebuild:
            shape = (p.batch, p.max_len, kv_heads, head_dim)
            mk[..., :p.max_len].copy_(k_buffer.index_select(0, kv_slots).view(shape).permute(0, 2, 3, 1))
            mv[:, :, :p.max_len].copy_(v_buffer.index_select(0, kv_slots).view(shape).transpose(1, 2))
        else:
            rows = p.batch * kv_heads
            mk.view(-1).index_copy_(0, p.append_keys, k.reshape(-1))
            mv.view(-1, head_dim).index_copy_(0, p.append_rows, v.reshape(rows, head_dim))
        rows = p.batch * kv_heads
        return (mk[..., :p.max_len].reshape(rows, head_dim, p.max_len),
                mv[:, :, :p.max_len].reshape(rows, p.max_len, head_dim))

    def _ensure_buffers(self, num_layers: int, batch: int, max_len: int, like: torch.Tensor) -> bool:
        """Buffers for at least `batch` requests and `max_len` positions plus room to append
        (False if they would exceed MAX_MIRROR_BYTES). Zero-filled when made: positions a
        request has not reached are read (and masked out) by the matmuls, so they must hold
        finite values."""
        kv_heads, head_dim = like.shape[1:]
        old = self._v[0] if self._v else None
        if (old is not None and len(self._v) == num_layers and old.shape[0] >= batch
                and old.shape[1] == kv_heads and old.shape[3] == head_dim and old.dtype == like.dtype
                and max_len + 4 <= old.shape[2] <= 2 * capacity(max_len)):
            return True
        cap = capacity(max_len)
        nbytes = 2 * num_layers * batch * kv_heads * cap * head_dim * like.element_size()
        if nbytes > MAX_MIRROR_BYTES:
            return False
        self._k = [like.new_zeros((batch, kv_heads, head_dim, cap)) for _ in range(num_layers)]
        self._v = [like.new_zeros((batch, kv_heads, cap, head_dim)) for _ in range(num_layers)]
        return True
