"""Builds a ForwardBatch from per-request token lists (metadata only; the one place a step
loops over its requests).

`build_batch` serves every mode; `build_decode_batch` is the decode step's fast path (one token
per request, host ints in): the step's eight int64 index vectors are written into one numpy
array and become tensors with one `from_numpy` — no per-field tensor, no `torch.cat` — then
go to the device in one copy, as in `build_batch`."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import numpy as np
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
    # numpy reads a flat iterator of ints several times faster than torch.tensor reads a list
    flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(new_tokens), np.int64, sum(ext)))
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


def build_decode_batch(rows: list[int], tokens: list[int], kv_lens: list[int], allocator: KVAllocator,
                       device: torch.device,
                       sampling_info: Optional[SamplingBatchInfo] = None) -> Optional[ForwardBatch]:
    """A DECODE batch: request i (KV row `rows[i]`, `kv_lens[i]` tokens cached) computes token
    `tokens[i]` at position `kv_lens[i]`. The same ForwardBatch as `build_batch(DECODE, rows,
    [[t] for t in tokens], kv_lens, ...)`, built from the host lists in a few numpy writes.
    Returns None (nothing allocated) if the slots do not fit."""
    b = len(rows)
    slots = allocator.alloc_decode(rows, kv_lens)
    if slots is None:
        return None
    seq_lens = [n + 1 for n in kv_lens]
    host = np.empty((len(INDEX_FIELDS), b), dtype=np.int64)  # rows in INDEX_FIELDS order
    host[0] = tokens  # input_ids
    host[1] = kv_lens  # positions
    host[2] = slots  # out_cache_loc
    host[3] = rows  # token_req_pool_indices
    host[4] = rows  # req_pool_indices
    host[5] = seq_lens
    host[6] = 1  # extend_seq_lens
    host[7] = kv_lens  # extend_prefix_lens
    flat = torch.from_numpy(host.reshape(-1))
    hi = HostIndices(INDEX_FIELDS, [b] * len(INDEX_FIELDS), flat)
    dev = flat if device.type == "cpu" else flat.pin_memory().to(device, non_blocking=True)
    ids, pos, loc, tok_rows, req_rows, lens, ext_d, prefix_d = dev.view(len(INDEX_FIELDS), b).unbind(0)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=b, input_ids=ids, positions=pos,
        req_pool_indices=req_rows, seq_lens=lens, out_cache_loc=loc,
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=[1] * b, extend_prefix_lens_cpu=kv_lens,
        extend_seq_lens=ext_d, extend_prefix_lens=prefix_d, token_req_pool_indices=tok_rows,
        sampling_info=sampling_info, host_indices=hi)


def _to_device(host: HostIndices, device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy for all of a step's int64 metadata, split into views there."""
    flat = host.flat if device.type == "cpu" else host.flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split(host.sizes))
