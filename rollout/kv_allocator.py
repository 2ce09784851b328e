"""The scheduler's record of KV memory: free request rows, free token slots, and which slots
each request row holds (a CPU mirror of the device's req_to_token, so freeing needs no sync).

Host-only bookkeeping, so it lives in numpy arrays: a slice or a fancy-index write costs a
fraction of a microsecond there against 1-2 µs per torch call, and a decode step runs a few of
them whatever the batch size."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

# Up to this many rows, alloc_decode records the slots with scalar writes: measured inside a
# decode loop (caches cold after the model's weights went through), 9 µs against 24 µs at batch 1.
_SCALAR_WRITES = 8


class KVAllocator:
    def __init__(self, num_req_slots: int, num_token_slots: int, max_context: int):
        """`num_token_slots` counts slot 0, the dummy that padded rows write to; it is never handed out."""
        self.capacity = num_token_slots - 1
        self._free_rows = list(range(num_req_slots - 1, -1, -1))
        self._free_slots = np.arange(1, num_token_slots, dtype=np.int64)
        # Freed slots wait here and join _free_slots only when it runs short: freeing is O(tokens
        # freed), never a copy of the whole free list (millions of slots on a GPU).
        self._released: list[np.ndarray] = []
        self._num_released = 0
        self.table = np.zeros((num_req_slots, max_context), dtype=np.int64)

    def reset(self) -> None:
        """Every row and slot free again (the state it was made in): after a call failed or was
        abandoned, when no request holds any."""
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))
        self._free_slots = np.arange(1, self.capacity + 1, dtype=np.int64)
        self._released, self._num_released = [], 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots) + self._num_released

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> Optional[int]:
        return self._free_rows.pop() if self._free_rows else None

    def _take(self, n: int) -> Optional[np.ndarray]:
        """n free slots (a view: the free list is never written in place), or None if too few."""
        free = self._free_slots
        if n > len(free):
            if n > len(free) + self._num_released:
                return None
            free = np.concatenate([free, *self._released])
            self._released, self._num_released = [], 0
        self._free_slots = free[n:]
        return free[:n]

    def alloc_slots(self, rows: np.ndarray, positions: np.ndarray) -> Optional[np.ndarray]:
        """Slots for the tokens at (rows[i], positions[i]) (int64 arrays); None (and nothing
        taken) if too few."""
        slots = self._take(len(rows))
        if slots is None:
            return None
        self.table[rows, positions] = slots
        return slots

    def alloc_decode(self, rows: Sequence[int], positions: Sequence[int]) -> Optional[np.ndarray]:
        """One slot per request row at its position (a decode step): host lists in, no tensors."""
        slots = self._take(len(rows))
        if slots is None:
            return None
        if len(rows) <= _SCALAR_WRITES:  # a few scalar writes beat numpy's fancy-index path
            table = self.table
            for row, pos, slot in zip(rows, positions, slots.tolist()):
                table[row, pos] = slot
        else:
            self.table[rows, positions] = slots
        return slots

    def free(self, row: int, num_tokens: int, start: int = 0) -> None:
        """Give back the row and the slots of its tokens start..num_tokens-1 (the first `start`
        are another owner's: a prompt group's shared slots)."""
        if num_tokens > start:
            self.release(self.table[row, start:num_tokens].copy())  # the row is reused later
        self._free_rows.append(row)

    def release(self, slots: np.ndarray) -> None:
        """Give back token slots no row holds any more."""
        if not len(slots):
            return
        self._released.append(slots)
        self._num_released += len(slots)
