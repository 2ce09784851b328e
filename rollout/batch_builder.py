"""Builds a ForwardBatch from per-request token lists (metadata only; the one place a step
loops over its requests)."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from rollout.forward_batch import ForwardBatch, ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.sampling_info import SamplingBatchInfo


def build_batch(mode: ForwardMode, rows: Sequence[int], new_tokens: Sequence[Sequence[int]],
                prefix_lens: Sequence[int], allocator: KVAllocator, device: torch.device,
                sampling_info: Optional[SamplingBatchInfo] = None,
                return_all_logits: bool = False) -> Optional[ForwardBatch]:
    """Allocates KV slots for the new tokens; returns None (nothing allocated) if they do not fit."""
    ext = [len(t) for t in new_tokens]
    ext_t = torch.tensor(ext, dtype=torch.int64)
    prefix_t = torch.tensor(prefix_lens, dtype=torch.int64)
    rows_t = torch.tensor(rows, dtype=torch.int64)
    token_rows = torch.repeat_interleave(rows_t, ext_t)
    starts = torch.cumsum(ext_t, 0) - ext_t
    offsets = torch.arange(int(ext_t.sum())) - torch.repeat_interleave(starts, ext_t)
    positions = torch.repeat_interleave(prefix_t, ext_t) + offsets
    slots = allocator.alloc_slots(token_rows, positions)
    if slots is None:
        return None
    seq_lens = [p + e for p, e in zip(prefix_lens, ext)]
    flat = list(itertools.chain.from_iterable(new_tokens))
    to = dict(device=device, non_blocking=True)
    return ForwardBatch(
        forward_mode=mode, batch_size=len(rows),
        input_ids=torch.tensor(flat, dtype=torch.int64).to(**to),
        positions=positions.to(**to), req_pool_indices=rows_t.to(**to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(**to), out_cache_loc=slots.to(**to),
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens=ext_t.to(**to), extend_prefix_lens=prefix_t.to(**to),
        token_req_pool_indices=token_rows.to(**to), sampling_info=sampling_info,
        return_all_logits=return_all_logits)
