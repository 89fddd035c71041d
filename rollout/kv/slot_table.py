"""The slot table: row r lists the pool slots of one running sequence's tokens, in order.

Keeping it as one device tensor lets the model runner gather every request's `kv_indices` with a
single indexing op instead of concatenating per-request lists each step.
"""

from __future__ import annotations

import torch

from ..ops.host_lists import host_tensor


class SlotTable:
    def __init__(self, max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.shape, self.device = (max_num_seqs, max_model_len), device
        self.allocate()

    def allocate(self) -> None:
        self.table = torch.zeros(self.shape, dtype=torch.int64, device=self.device)
        self._free_rows = list(range(self.shape[0] - 1, -1, -1))

    def release(self) -> None:
        self.table = None

    def alloc_row(self) -> int:
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def unfree_row(self, row: int) -> None:
        """Undo the latest `free_row(row)`."""
        assert self._free_rows[-1] == row, "unfree_row: not the newest freed row"
        self._free_rows.pop()

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def free_rows(self) -> tuple[int, ...]:
        """The free rows, the next alloc_row()'s last (a copy: for checks and tests)."""
        return tuple(self._free_rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start:start + slots.numel()] = slots

    def write_each(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """slots[i] goes to (rows[i], cols[i]): a whole decode step's growth in one op."""
        self.table[self._cells(rows, cols)] = slots

    def read_each(self, rows: list[int], cols: list[int]) -> torch.Tensor:
        """The slots at (rows[i], cols[i]), in one op."""
        return self.table[self._cells(rows, cols)]

    def _cells(self, rows: list[int], cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = host_tensor([*rows, *cols], torch.int64, self.device)
        return index[:len(rows)], index[len(rows):]

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        return self.table[row, start:end]
