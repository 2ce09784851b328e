"""Builds a ForwardBatch from per-request token lists (metadata only; the one place a step
loops over its requests)."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from rollout.forward_batch import INDEX_FIELDS, ForwardBatch, ForwardMode, HostIndices
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
    if mode.is_decode:  # one token per request: no ragged bookkeeping
        token_rows, positions = rows_t, prefix_t
    else:
        token_rows = torch.repeat_interleave(rows_t, ext_t)
        starts = torch.cumsum(ext_t, 0) - ext_t
        offsets = torch.arange(int(ext_t.sum())) - torch.repeat_interleave(starts, ext_t)
        positions = torch.repeat_interleave(prefix_t, ext_t) + offsets
    slots = allocator.alloc_slots(token_rows, positions)
    if slots is None:
        return None
    seq_lens = [p + e for p, e in zip(prefix_lens, ext)]
    flat = torch.tensor(list(itertools.chain.from_iterable(new_tokens)), dtype=torch.int64)
    parts = (flat, positions, slots, token_rows, rows_t, torch.tensor(seq_lens, dtype=torch.int64),
             ext_t, prefix_t)
    host = HostIndices(INDEX_FIELDS, [p.numel() for p in parts], torch.cat(parts))
    ids, pos, loc, tok_rows, req_rows, lens, ext_d, prefix_d = _to_device(host, device)
    return ForwardBatch(
        forward_mode=mode, batch_size=len(rows), input_ids=ids, positions=pos,
        req_pool_indices=req_rows, seq_lens=lens, out_cache_loc=loc,
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens=ext_d, extend_prefix_lens=prefix_d, token_req_pool_indices=tok_rows,
        sampling_info=sampling_info, return_all_logits=return_all_logits, host_indices=host)


def _to_device(host: HostIndices, device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy for all of a step's int64 metadata, split into views there."""
    flat = host.flat if device.type == "cpu" else host.flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split(host.sizes))
