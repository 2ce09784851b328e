"""KV memory: request slots, token slots (slot 0 is a dummy for padded rows) and the KV pools."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Iterable, Optional, Sequence

import torch

from rollout.errors import ConfigError, KVCacheBudgetError
from rollout.routing_record import RoutingPool

logger = logging.getLogger(__name__)

# GPU: the rotary kernel also writes each layer's new K and V (no store kernel). 0: off (A/B).
FUSED_ROPE_KV = os.environ.get("ROLLOUT_FUSED_ROPE_KV", "1") != "0"


class ReqToTokenPool:
    """int32 [max_reqs, max_context] on the device: request slot → KV slot of each token.

    Rows are written by the ModelRunner from each ForwardBatch (so every TP rank keeps the same
    table without extra messages); which rows and slots are free is the scheduler's KVAllocator."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str):
        self.max_context = max_context
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32, device=device)
        self._fused = None  # on a GPU: one Triton launch a write (triton: GPU-only dep)
        if torch.device(device).type == "cuda":
            from rollout.attention.triton_kernels import req_to_token
            self._fused = req_to_token

    def write(self, token_req_slots: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor) -> None:
        if self._fused is not None:  # one kernel, not a cast of the int64 slots and an index write
            self._fused.write_slots(self.req_to_token, token_req_slots, positions, kv_slots)
            return
        self.req_to_token[token_req_slots, positions] = kv_slots.to(torch.int32)


class TokenToKVPool:
    """Per-layer K and V buffers [num_slots, kv_heads_per_rank, head_dim]."""

    def __init__(self, num_slots: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str,
                 routing: Optional[RoutingPool] = None):
        shape = (num_slots, kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._fused = None  # on a GPU: one Triton launch stores a step's K and V (triton: GPU-only dep)
        # the experts each slot's token was routed to (`routing_record`), when they are recorded
        self.routing = routing
        if torch.device(device).type == "cuda":
            from rollout.attention.triton_kernels import store_kv
            self._fused = store_kv

    def rotary_store_target(self, layer_id: int, loc: torch.Tensor, v: torch.Tensor
                            ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(v, loc, k_buffer, v_buffer) for a rotary kernel that stores the layer's keys and
        values itself (`triton_ops.KVStore`), or None where `set_kv` must (off a GPU, rows not
        flat, other head shapes, or ROLLOUT_FUSED_ROPE_KV=0)."""
        fused = self._fused
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if (fused is None or not FUSED_ROPE_KV or not fused.rows_are_flat(v)
                or v.shape[1:] != k_buf.shape[1:] or v.device != k_buf.device):
            return None
        return v, loc, k_buf, v_buf

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = self.k_buffers[layer_id], self.v_buffers[layer_id]
        fused = self._fused
        if (fused is not None and fused.rows_are_flat(k) and fused.rows_are_flat(v)
                and k.shape[1:] == k_buf.shape[1:]):
            fused.store_kv(k, v, loc, k_buf, v_buf)  # one launch instead of two index kernels
            return
        k_buf[loc] = k.to(k_buf.dtype)
        v_buf[loc] = v.to(v_buf.dtype)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)

    def tensors(self) -> list[torch.Tensor]:
        return self.k_buffers + self.v_buffers


MEMORY_TAGS = ("kv_cache", "weights")
StorageRecord = tuple[torch.Tensor, int]  # a tensor whose storage was freed, and its size in bytes


def check_memory_tags(tags: Sequence[str]) -> list[str]:
    """The tags as a list; a ConfigError for an unknown one or a bare string."""
    if isinstance(tags, str) or not all(t in MEMORY_TAGS for t in tags):
        raise ConfigError(f"memory tags must be a sequence drawn from {MEMORY_TAGS}, got {tags!r}")
    return list(dict.fromkeys(tags))


def free_storages(tensors: Iterable[torch.Tensor]) -> list[StorageRecord]:
    """Free each tensor's memory by resizing its storage to 0 bytes. The tensor objects stay the
    same (pools, attention backends and the model keep their references); only their memory
    goes. Tensors sharing a storage (tied weights) are freed, and later restored, once."""
    records = []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            records.append((t, storage.nbytes()))
            storage.resize_(0)
    return records


def return_freed_host_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). A freed CPU storage
    below glibc's mmap threshold, which rises up to 32 MiB after a larger block is freed, goes
    back to the heap and stays in the process's RSS until trimmed. No-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def restore_storages(records: Iterable[StorageRecord]) -> None:
    """Re-allocate freed storages at their old size. Contents are undefined and the address may
    change (so CUDA graphs that captured the old one must be captured again)."""
    for t, nbytes in records:
        t.untyped_storage().resize_(nbytes)


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def kv_capacity_tokens(*, bytes_per_token: int, tokens: Optional[int] = None,
                       budget_bytes: Optional[int] = None, free_before_load: Optional[int] = None,
                       mem_fraction: float = 0.85, weights_bytes: int = 0,
                       preloaded_weights_bytes: int = 0, default_tokens: int = 65536) -> int:
    """Tokens the KV cache can hold.

    Explicit budgets win. On GPU: free memory measured before the weights loaded, times
    mem_fraction, minus the weights this engine loaded; weights already resident at that
    measurement (`preloaded_weights_bytes`) were not in the free figure, so they are added back."""
    for name, v in (("preloaded_weights_bytes", preloaded_weights_bytes), ("weights_bytes", weights_bytes)):
        if not isinstance(v, int) or v < 0:
            raise KVCacheBudgetError(f"{name} must be a non-negative integer, got {v!r}")
    if tokens is not None:
        return tokens
    if budget_bytes is not None:
        return budget_bytes // bytes_per_token
    if free_before_load is None:
        return default_tokens
    available = int(free_before_load * mem_fraction) - weights_bytes + preloaded_weights_bytes
    if available <= 0:
        raise KVCacheBudgetError(
            f"no memory left for the KV cache: free {free_before_load} B x mem_fraction {mem_fraction}"
            f" - weights {weights_bytes} B + preloaded {preloaded_weights_bytes} B = {available} B; "
            "raise mem_fraction or free GPU memory")
    return available // bytes_per_token
