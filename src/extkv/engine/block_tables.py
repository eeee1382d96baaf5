"""Every sequence's block tables as rows of one host array, for the step inputs.

The block manager keeps a sequence's tables as Python lists (what its bookkeeping
reads) and writes each change into this array too: new blocks at a table's end, a
window's released entries, moves, a freed row. A step's tables are then one numpy
gather over its sequences' rows, where building them from the lists converts every
entry of every table, every step (at 256 sequences of a few hundred tokens, about a
third of the host's time per decode step).

Each sequence holding blocks has a row (`Sequence.table_row`); its entries past its
tables' lengths are 0, as the step inputs pad them.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class HostBlockTables:
    """Rows of block ids, one per sequence holding blocks, for every KV cache group:
    `ids[group, row, i]` is entry i of that sequence's table in `group`, `lengths[group,
    row]` its table's length. Rows and columns grow as needed (doubling)."""

    def __init__(self, num_groups: int, num_rows: int = 16, num_columns: int = 16) -> None:
        self.ids = np.zeros((num_groups, num_rows, num_columns), dtype=np.int32)
        self.lengths = np.zeros((num_groups, num_rows), dtype=np.int64)
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    def add_row(self) -> int:
        """A zeroed row for a sequence that takes its first blocks."""
        if not self._free_rows:
            rows = self.ids.shape[1]
            self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)], axis=1)
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)], axis=1)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def free_row(self, row: int, longest: int) -> None:
        """Zero `row` (its longest table has `longest` entries) for another sequence."""
        self.ids[:, row, :longest] = 0
        self.lengths[:, row] = 0
        self._free_rows.append(row)

    def extend(self, row: int, group: int, start: int, block_ids: list[int]) -> None:
        """Append `block_ids` to `row`'s table in `group`, `start` entries long so far."""
        end = start + len(block_ids)
        if end > self.ids.shape[2]:
            columns = max(end, 2 * self.ids.shape[2])
            wider = np.zeros((*self.ids.shape[:2], columns), dtype=self.ids.dtype)
            wider[:, :, : self.ids.shape[2]] = self.ids
            self.ids = wider
        if len(block_ids) == 1:  # a decode's new block: a scalar write, no list converted
            self.ids[group, row, start] = block_ids[0]
        else:
            self.ids[group, row, start:end] = block_ids
        self.lengths[group, row] = end

    def set(self, row: int, group: int, start: int, block_ids: list[int]) -> None:
        """Overwrite entries start.. of `row`'s table in `group` (within its length)."""
        self.ids[group, row, start : start + len(block_ids)] = block_ids

    def move(self, moves: Mapping[int, int]) -> None:
        """Rewrite every entry `old` of `moves` ({old: new}) to `new`, in every row."""
        if not moves:
            return
        old = np.fromiter(moves.keys(), np.int64, len(moves))
        new = np.fromiter(moves.values(), np.int64, len(moves))
        # A move's source lies past the new end (>= 1): block 0 is never one, so 0 entries
        # (padding or block 0) stay, and so do NO_BLOCK's -1. Only columns in use count.
        ids = self.ids[:, :, : int(self.lengths.max())]
        lookup = np.arange(max(int(old.max()), int(ids.max(initial=0))) + 1, dtype=np.int32)
        lookup[old] = new
        held = ids > 0
        ids[held] = lookup[ids[held]]

    def gather(self, groups: slice, rows: np.ndarray) -> np.ndarray:
        """The tables of `rows` in `groups`, as (groups, len(rows), longest), 0-padded."""
        width = int(self.lengths[groups, rows].max()) if len(rows) else 0
        return self.ids[groups, rows, :width]
