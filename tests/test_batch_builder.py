"""Spec for the batch builder: one packed array of a step's indices whatever the token input
(lists or the request builder's int64 arrays), with an EXTEND batch's logits rows in it, and a
decode step's sampling uniforms."""
import numpy as np
import pytest
import torch

from rollout.batch_builder import build_batch, build_decode_batch
from rollout.forward_batch import INDEX_FIELDS, LOGITS_ROWS, ForwardMode
from rollout.kv_allocator import KVAllocator
from rollout.random_stream import uniform_from
from rollout.sampling_info import SamplingBatchInfo
from rollout.sampling_params import SamplingParams
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


GPU = pytest.param(torch.device("cuda"), marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", [CPU, GPU], ids=str)
def test_decode_batch_brings_its_rows_uniforms_in_its_copy(device):
    """A decode step of the rows of a SamplingBatchInfo moves its uniforms on to the step's
    positions (seq_lens) in the batch's one packed array (one copy to a GPU), a float64 row after
    the indices; its other tensors stay; the indices are those of a batch without it, and TP
    followers get them."""
    kv_lens, seeds = [4, 9, 2], [7, -3, 11]

    def decode(info=None):
        alloc = KVAllocator(8, 256, 64)
        rows = [alloc.alloc_row() for _ in kv_lens]
        return build_decode_batch(rows, [11, 12, 13], kv_lens, alloc, device, sampling_info=info)

    info = SamplingBatchInfo.build([SamplingParams(temperature=0.7)] * 3, seeds, kv_lens, 32, device)
    temperatures = info.temperatures
    plain, fb = decode(), decode(info)
    assert fb.sampling_info is info and info.temperatures is temperatures
    assert info.uniforms.dtype == torch.float64
    assert info.uniforms.tolist() == uniform_from(seeds, fb.seq_lens_cpu).tolist()
    assert info.uniforms.untyped_storage().data_ptr() == fb.input_ids.untyped_storage().data_ptr()
    assert fb.stacked(INDEX_FIELDS) is not None
    assert _fields(fb) == _fields(plain)
    assert fb.host_indices.flat.equal(plain.host_indices.flat)
    assert _fields(BatchMessage.from_batch(fb).to_batch(CPU)) == _fields(plain)
