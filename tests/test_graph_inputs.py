"""Spec: a decode graph's input kernel (rollout/triton_graph_inputs.py) leaves the static table
and req_to_token exactly as the three ops it replaces do — the copy of the step's index rows,
the padding of rows past the batch, the pending input ids taken from the previous step's device
tokens, and ReqToTokenPool.write of the new KV slots. On CPU under the Triton interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from rollout import triton_graph_inputs  # noqa: E402
from rollout.cuda_graph_runner import PAD_FIELDS, GraphInputs  # noqa: E402
from rollout.forward_batch import INDEX_FIELDS  # noqa: E402
from rollout.memory import ReqToTokenPool  # noqa: E402
from tests.helpers import DEV, require_runnable_triton  # noqa: E402

require_runnable_triton(triton_graph_inputs._fill_kernel)

MAX_BS, ROWS, CONTEXT = 16, 20, 64


def _step(bs: int, seed: int) -> torch.Tensor:
    """A decode step's packed index rows [8, bs] in INDEX_FIELDS order (as build_decode_batch
    lays them out): distinct request rows, positions, slots."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(ROWS, generator=g)[:bs]
    positions = torch.randint(0, CONTEXT, (bs,), generator=g)
    slots = torch.randint(1, 2**20, (bs,), generator=g)
    ids = torch.randint(0, 1000, (bs,), generator=g)
    return torch.stack([ids, positions, slots, rows, rows, positions + 1,
                        torch.ones(bs, dtype=torch.int64), positions])


def _reference(packed, tokens, graph_bs, table, pad, pool):
    """The three ops: input ids taken in, the rows copied and padded, the slots written."""
    ids = packed[0] if tokens is None else tokens
    bs = packed.shape[1]
    table[:, :bs] = packed[:len(PAD_FIELDS)]
    table[0, :bs] = ids
    table[:, bs:graph_bs] = pad[:, bs:graph_bs]
    pool.req_to_token[packed[3], packed[1]] = packed[2].to(torch.int32)


@pytest.mark.parametrize("bs,graph_bs", [(1, 1), (5, 8), (16, 16), (3, 3)])
@pytest.mark.parametrize("pending", [False, True])
def test_fill_kernel_equals_the_three_ops(bs, graph_bs, pending):
    assert INDEX_FIELDS[:len(PAD_FIELDS)] == PAD_FIELDS
    packed = _step(bs, seed=bs * 7 + pending)
    tokens = torch.arange(500, 500 + bs) if pending else None
    got, want = GraphInputs.allocate(MAX_BS, DEV), GraphInputs.allocate(MAX_BS, DEV)
    pools = [ReqToTokenPool(ROWS, CONTEXT, DEV) for _ in range(2)]
    for inputs, pool in zip((got, want), pools):
        inputs.table.fill_(-3)  # a previous step's leftovers: every written cell must change
        pool.req_to_token.fill_(-7)
    triton_graph_inputs.fill_decode_inputs(packed[:len(PAD_FIELDS)].to(DEV), got.table, got.pad,
                                           None if tokens is None else tokens.to(DEV),
                                           pools[0].req_to_token, graph_bs)
    _reference(packed.to(DEV), None if tokens is None else tokens.to(DEV), graph_bs, want.table,
               want.pad, pools[1])
    assert torch.equal(got.table, want.table)
    assert torch.equal(pools[0].req_to_token, pools[1].req_to_token)
    assert (got.table[:, graph_bs:] == -3).all()  # rows past the graph's batch untouched


def test_fill_kernel_refuses_misfit_shapes():
    inputs = GraphInputs.allocate(MAX_BS, DEV)
    r2t = torch.zeros(ROWS, CONTEXT, dtype=torch.int32, device=DEV)
    src = _step(4, 0)[:len(PAD_FIELDS)].to(DEV)
    with pytest.raises(ValueError, match="do not fit"):
        triton_graph_inputs.fill_decode_inputs(src, inputs.table, inputs.pad, None, r2t, graph_bs=2)
    with pytest.raises(ValueError, match="do not fit"):
        triton_graph_inputs.fill_decode_inputs(src[:5], inputs.table, inputs.pad, None, r2t, 4)
    with pytest.raises(ValueError, match="one contiguous id per row"):
        triton_graph_inputs.fill_decode_inputs(src, inputs.table, inputs.pad,
                                               torch.zeros(3, dtype=torch.int64, device=DEV), r2t, 4)


# ---- a decode step graph's input kernel (`step_graphs`) --------------------------------------
def _step_source(packed: torch.Tensor, graph_bs: int, take_previous: list[bool]) -> torch.Tensor:
    """The step source table [STEP_ROWS, MAX_BS] of a step: its index rows (input ids
    TAKE_PREVIOUS where the row takes the previous step's token), padded columns of the
    padded-row values, garbage sampler rows (the kernel does not read them), the batch size."""
    src = torch.full((triton_graph_inputs.STEP_ROWS, MAX_BS), 12345, dtype=torch.int64)
    bs = packed.shape[1]
    src[:len(PAD_FIELDS), :bs] = packed[:len(PAD_FIELDS)]
    src[0, :bs][torch.tensor(take_previous)] = triton_graph_inputs.TAKE_PREVIOUS
    src[:len(PAD_FIELDS), bs:graph_bs] = GraphInputs.allocate(1, "cpu").pad[:, :1]
    src[triton_graph_inputs.STEP_BS, 0] = bs
    return src


@pytest.mark.parametrize("bs,graph_bs", [(1, 1), (5, 8), (16, 16), (3, 4)])
def test_step_fill_kernel_equals_the_three_ops(bs, graph_bs):
    """The captured step's input kernel: the same table and req_to_token as the decode graph's
    three ops, the batch size read from the source (not passed), a row's pending input id taken
    from the previous step's tokens (row for row), the padded columns' values copied as they are
    and their KV slots never written."""
    packed = _step(bs, seed=bs * 11 + graph_bs)
    take = [i % 2 == 0 for i in range(bs)]
    previous = torch.arange(700, 700 + MAX_BS)
    src = _step_source(packed, graph_bs, take)
    got, want = GraphInputs.allocate(MAX_BS, DEV), GraphInputs.allocate(MAX_BS, DEV)
    pools = [ReqToTokenPool(ROWS, CONTEXT, DEV) for _ in range(2)]
    for inputs, pool in zip((got, want), pools):
        inputs.table.fill_(-3)
        pool.req_to_token.fill_(-7)
    triton_graph_inputs.fill_step_inputs(src.to(DEV), got.table, previous.to(DEV),
                                         pools[0].req_to_token, graph_bs)
    ids = torch.where(torch.tensor(take), previous[:bs], packed[0])
    _reference(packed.to(DEV), ids.to(DEV), graph_bs, want.table, want.pad, pools[1])
    assert torch.equal(got.table, want.table)
    assert torch.equal(pools[0].req_to_token, pools[1].req_to_token)
    assert (got.table[:, graph_bs:] == -3).all()


def test_step_fill_kernel_refuses_misfit_shapes():
    inputs = GraphInputs.allocate(MAX_BS, DEV)
    r2t = torch.zeros(ROWS, CONTEXT, dtype=torch.int32, device=DEV)
    src = _step_source(_step(4, 0), 4, [False] * 4).to(DEV)
    tokens = torch.zeros(MAX_BS, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="do not fit"):
        triton_graph_inputs.fill_step_inputs(src[:9], inputs.table, tokens, r2t, 4)
    with pytest.raises(ValueError, match="do not fit"):
        triton_graph_inputs.fill_step_inputs(src, inputs.table, tokens[:3], r2t, 4)
    with pytest.raises(ValueError, match="do not fit"):
        triton_graph_inputs.fill_step_inputs(src, inputs.table, tokens, r2t, MAX_BS + 1)
    with pytest.raises(ValueError, match="unit stride"):
        triton_graph_inputs.fill_step_inputs(src, inputs.table, tokens[::2].repeat(2)[::2], r2t, 4)
