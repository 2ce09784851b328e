"""One launch that records a step's new KV slots in the int32 req_to_token table.

`table[rows, positions] = slots.to(torch.int32)` is two kernels a step (the cast of the int64
slots, then the index write), each with its launch gap before the decode graph; this kernel
reads the int64 slots and writes them as int32 itself."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.triton_pdl import launch_options, pdl_wait

BLOCK = 1024  # tokens a program: one program for any decode batch


# the token count and the index rows' addresses (views of a step's packed array, aligned by
# its length) not specialized on: one variant for every batch, compiled ahead (cuda_graph_runner)
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["Rows", "Positions", "Slots"])
def _write_slots_kernel(Table, Rows, Positions, Slots, n, stride_table, stride_rows, stride_pos,
                        stride_slots, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # before any read of an earlier kernel's output or any write
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = tl.load(Rows + offs * stride_rows, mask=mask, other=0).to(tl.int64)
    pos = tl.load(Positions + offs * stride_pos, mask=mask, other=0).to(tl.int64)
    slot = tl.load(Slots + offs * stride_slots, mask=mask, other=0)
    tl.store(Table + row * stride_table + pos, slot.to(tl.int32), mask=mask)


def write_slots(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor) -> None:
    """table[rows[i], positions[i]] = int32(slots[i]) for every token i (1-D index tensors, the
    allocator's: in range, no (row, position) twice)."""
    n = rows.shape[0]
    if n == 0:
        return
    _write_slots_kernel[(triton.cdiv(n, BLOCK),)](
        table, rows, positions, slots, n, table.stride(0), rows.stride(0), positions.stride(0),
        slots.stride(0), BLOCK=BLOCK, num_warps=4, **launch_options())
