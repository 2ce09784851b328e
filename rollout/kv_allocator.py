"""The scheduler's record of KV memory: free request rows, free token slots, and which slots
each request row holds (a CPU mirror of the device's req_to_token, so freeing needs no sync)."""
from __future__ import annotations

from typing import Optional

import torch


class KVAllocator:
    def __init__(self, num_req_slots: int, num_token_slots: int, max_context: int):
        """`num_token_slots` counts slot 0, the dummy that padded rows write to; it is never handed out."""
        self.capacity = num_token_slots - 1
        self._free_rows = list(range(num_req_slots - 1, -1, -1))
        self._free_slots = torch.arange(1, num_token_slots, dtype=torch.int64)
        # Freed slots wait here and join _free_slots only when it runs short: freeing is O(tokens
        # freed), never a copy of the whole free list (millions of slots on a GPU).
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        self.table = torch.zeros(num_req_slots, max_context, dtype=torch.int64)

    @property
    def num_free_slots(self) -> int:
        return int(self._free_slots.numel()) + self._num_released

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def alloc_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """Slots for the tokens at (rows[i], positions[i]); None (and nothing taken) if too few."""
        n = int(rows.numel())
        if n > self.num_free_slots:
            return None
        if n > self._free_slots.numel():
            self._free_slots = torch.cat([self._free_slots, *self._released])
            self._released, self._num_released = [], 0
        slots, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        self.table[rows, positions] = slots
        return slots

    def free(self, row: int, num_tokens: int) -> None:
        """Give back the row and the slots of its first `num_tokens` tokens."""
        if num_tokens:
            self._released.append(self.table[row, :num_tokens].clone())  # the row is reused later
            self._num_released += num_tokens
        self._free_rows.append(row)
