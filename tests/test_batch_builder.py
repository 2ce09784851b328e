"""Spec for the batch builder: one packed array of a step's indices whatever the token input
(lists or the request builder's int64 arrays), with an EXTEND batch's logits rows in it."""
import numpy as np
import pytest
import torch

from rollout.batch_builder import build_batch
from rollout.forward_batch import INDEX_FIELDS, LOGITS_ROWS, ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.tp_worker import BatchMessage

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
PREFIX = [0, 4, 2]


def _build(tokens, mode=ForwardMode.EXTEND, return_all_logits=False):
    alloc = KVAllocator(8, 256, 64)
    rows = [alloc.alloc_row() for _ in tokens]
    return build_batch(mode, rows, tokens, PREFIX[:len(tokens)], alloc, CPU,
                       return_all_logits=return_all_logits), alloc


def _fields(fb):
    return {name: getattr(fb, name).tolist() for name in INDEX_FIELDS + (LOGITS_ROWS,)
            if getattr(fb, name) is not None}


@pytest.mark.parametrize("arrays", ["all", "some"])
def test_array_tokens_build_the_batch_lists_build(arrays):
    as_arrays = [np.array(p, dtype=np.int64) if arrays == "all" or i == 1 else p
                 for i, p in enumerate(PROMPTS)]
    (want, want_alloc), (got, got_alloc) = _build(PROMPTS), _build(as_arrays)
    assert _fields(got) == _fields(want)
    assert (got.seq_lens_cpu, got.extend_seq_lens_cpu, got.extend_prefix_lens_cpu) == \
        (want.seq_lens_cpu, want.extend_seq_lens_cpu, want.extend_prefix_lens_cpu)
    assert np.array_equal(got_alloc.table, want_alloc.table)


def test_extend_batch_packs_its_logits_rows():
    fb, _ = _build(PROMPTS)
    assert fb.input_ids.tolist() == sum(PROMPTS, [])
    assert fb.positions.tolist() == [0, 1, 2, 4, 2, 3, 4, 5, 6]
    assert fb.logits_indices().tolist() == [2, 3, 8]  # each request's last token
    host = fb.host_indices
    assert host.names == INDEX_FIELDS + (LOGITS_ROWS,) and sum(host.sizes) == host.flat.numel()
    assert fb.logits_rows.untyped_storage().data_ptr() == host.flat.untyped_storage().data_ptr()


def test_no_logits_rows_where_every_row_or_no_selection_is_read():
    all_rows, _ = _build(PROMPTS, return_all_logits=True)
    decode, _ = _build([[5], [6]], ForwardMode.DECODE)
    for fb in (all_rows, decode):
        assert fb.logits_rows is None and fb.logits_indices() is None
        assert fb.host_indices.names == INDEX_FIELDS


def test_tp_followers_get_the_logits_rows():
    fb, _ = _build(PROMPTS)
    got = BatchMessage.from_batch(fb).to_batch(CPU)
    assert got.logits_indices().tolist() == fb.logits_indices().tolist()
    assert _fields(got) == _fields(fb)
