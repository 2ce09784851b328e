"""Builds a ForwardBatch from per-request token lists (metadata only; the one place a step
loops over its requests).

Both builders write the step's int64 index vectors into one numpy array (a small numpy op
costs ~1 µs, a small torch op ~5 µs), which becomes a tensor with one `from_numpy` — no
per-field tensor, no `torch.cat` — and goes to the device in one copy. `build_batch` serves
every mode; `build_decode_batch` is the decode step's fast path (one token per request, host
ints in), whose copy also carries the sampling uniforms when the rows keep their
SamplingBatchInfo: one host-to-device copy a step."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import numpy as np
import torch

from rollout.forward_batch import (INDEX_FIELDS, LOGITS_ROWS, NUM_TOKEN_FIELDS, SHARED_FIELDS,
                                   ForwardBatch, ForwardMode, HostIndices)
from rollout.host_to_device import to_device
from rollout.kv_allocator import KVAllocator
from rollout.sampling_info import SamplingBatchInfo


def build_batch(mode: ForwardMode, rows: Sequence[int], new_tokens: Sequence[Sequence[int]],
                prefix_lens: Sequence[int], allocator: KVAllocator, device: torch.device,
                sampling_info: Optional[SamplingBatchInfo] = None,
                return_all_logits: bool = False,
                shared: Optional[Sequence[tuple[int, int, int]]] = None
                ) -> Optional[ForwardBatch]:
    """Allocates KV slots for the new tokens; returns None (nothing allocated) if they do not fit.

    `new_tokens[i]`: a list of ints or an int64 numpy array (a request's prompt as the request
    builder keeps it: no conversion here). An EXTEND batch that needs only last-token logits
    carries their rows in its packed indices (`ForwardBatch.logits_rows`): the LM head needs
    no copy of its own. `shared`: (row, source row, n) for rows that start with cached tokens
    computed for another row (a prompt's KV shared by its samples, `prompt_group`): the first
    n slots of the source row (after this batch's allocation, so a source in this batch has
    its new slots) go to the row's first n, in the allocator's table and, packed with the
    rest (`SHARED_FIELDS`), in the device's req_to_token."""
    b = len(rows)
    ext = np.fromiter(map(len, new_tokens), np.int64, b)
    ends = np.cumsum(ext)
    num_tokens = int(ends[-1]) if b else 0
    names = INDEX_FIELDS if mode.is_decode or return_all_logits else INDEX_FIELDS + (LOGITS_ROWS,)
    per_request_fields = len(names) - NUM_TOKEN_FIELDS
    sizes = [num_tokens] * NUM_TOKEN_FIELDS + [b] * per_request_fields
    if shared is not None:
        names += SHARED_FIELDS
        sizes += [sum(n for _, _, n in shared)] * len(SHARED_FIELDS)
    # every field written in place into one array, in `names` order: no per-field tensor, no cat
    host = np.empty(sum(sizes), dtype=np.int64)
    split = NUM_TOKEN_FIELDS * num_tokens
    ids, positions, slots, token_rows = host[:split].reshape(NUM_TOKEN_FIELDS, num_tokens)
    per_request_end = split + b * per_request_fields
    per_request = host[split:per_request_end].reshape(per_request_fields, b)
    req_rows, seq_lens, ext_lens, prefix = per_request[:4]
    req_rows[:] = rows
    ext_lens[:] = ext
    prefix[:] = prefix_lens
    np.add(prefix, ext, out=seq_lens)
    token_rows[:] = np.repeat(req_rows, ext)
    # token j of request i sits at prefix_i + j; its flat index is start_i + j
    np.add(np.arange(num_tokens), np.repeat(prefix - (ends - ext), ext), out=positions)
    taken = allocator.alloc_slots(token_rows, positions)
    if taken is None:
        return None
    slots[:] = taken
    if shared is not None:
        _share_rows(shared, allocator, host[per_request_end:].reshape(len(SHARED_FIELDS), -1))
    _write_tokens(new_tokens, ids)
    if LOGITS_ROWS in names:
        np.subtract(ends, 1, out=per_request[4])  # each request's last token
    flat = torch.from_numpy(host)
    host_indices = HostIndices(names, sizes, flat)
    dev = dict(zip(names, _to_device(host_indices, device)))
    return ForwardBatch(
        forward_mode=mode, batch_size=b, seq_lens_cpu=seq_lens.tolist(),
        extend_seq_lens_cpu=ext.tolist(), extend_prefix_lens_cpu=list(prefix_lens),
        sampling_info=sampling_info, return_all_logits=return_all_logits,
        host_indices=host_indices, **dev)


def _share_rows(shared: Sequence[tuple[int, int, int]], allocator: KVAllocator,
                out: np.ndarray) -> None:
    """Each (row, source, n): the row's first n table entries become the source row's; `out`
    [3, total] gets the (rows, positions, slots) written."""
    rows, positions, slots = out
    start = 0
    for row, source, n in shared:
        end = start + n
        rows[start:end] = row
        positions[start:end] = np.arange(n)
        slots[start:end] = allocator.table[source, :n]
        allocator.table[row, :n] = slots[start:end]
        start = end


def _write_tokens(new_tokens: Sequence[Sequence[int]], out: np.ndarray) -> None:
    """The requests' tokens, flat, into `out`: one copy when all are numpy arrays (prompts as
    the request builder keeps them), else one read of the ints (numpy reads a flat iterator of
    ints several times faster than torch.tensor reads a list)."""
    if len(new_tokens) and all(type(t) is np.ndarray for t in new_tokens):
        np.concatenate(new_tokens, out=out)
    else:
        out[:] = np.fromiter(itertools.chain.from_iterable(new_tokens), np.int64, len(out))


def build_decode_batch(rows: list[int], tokens: list[int], kv_lens: list[int], allocator: KVAllocator,
                       device: torch.device,
                       sampling_info: Optional[SamplingBatchInfo] = None) -> Optional[ForwardBatch]:
    """A DECODE batch: request i (KV row `rows[i]`, `kv_lens[i]` tokens cached) computes token
    `tokens[i]` at position `kv_lens[i]`. The same ForwardBatch as `build_batch(DECODE, rows,
    [[t] for t in tokens], kv_lens, ...)`, built from the host lists in a few numpy writes.
    Returns None (nothing allocated) if the slots do not fit.

    `sampling_info`: these rows' SamplingBatchInfo from their previous decode step, attached to
    the batch with its uniforms moved on to this step's positions: they travel as a float64 row
    after the indices, in the same copy (the rest of its tensors stay as they are)."""
    b = len(rows)
    slots = allocator.alloc_decode(rows, kv_lens)
    if slots is None:
        return None
    seq_lens = [n + 1 for n in kv_lens]
    num_index = len(INDEX_FIELDS)
    # rows in INDEX_FIELDS order, then the uniforms (at 64·b bytes: 16-byte aligned, as the
    # sampler's other tensors)
    host = np.empty((num_index + (sampling_info is not None), b), dtype=np.int64)
    host[0] = tokens  # input_ids
    host[1] = kv_lens  # positions
    host[2] = slots  # out_cache_loc
    host[3] = rows  # token_req_pool_indices
    host[4] = rows  # req_pool_indices
    host[5] = seq_lens
    host[6] = 1  # extend_seq_lens
    host[7] = kv_lens  # extend_prefix_lens
    if sampling_info is not None:
        host[num_index].view(np.float64)[:] = sampling_info.uniforms_at(seq_lens)
    packed = torch.from_numpy(host)
    hi = HostIndices(INDEX_FIELDS, [b] * num_index, packed[:num_index].view(-1))
    dev = to_device(packed, device)
    ids, pos, loc, tok_rows, req_rows, lens, ext_d, prefix_d = dev[:num_index].unbind(0)
    if sampling_info is not None:
        sampling_info.uniforms = dev[num_index].view(torch.float64)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=b, input_ids=ids, positions=pos,
        req_pool_indices=req_rows, seq_lens=lens, out_cache_loc=loc,
        seq_lens_cpu=seq_lens, extend_seq_lens_cpu=[1] * b, extend_prefix_lens_cpu=kv_lens,
        extend_seq_lens=ext_d, extend_prefix_lens=prefix_d, token_req_pool_indices=tok_rows,
        sampling_info=sampling_info, host_indices=hi)


def _to_device(host: HostIndices, device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy for all of a step's int64 metadata, split into views there."""
    return list(to_device(host.flat, device).split(host.sizes))
