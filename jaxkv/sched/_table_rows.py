"""Block tables as rows of one int32 array per KV-cache group, kept in step
with the manager's per-request lists, so a batch's block table is one gather
(no per-step rebuild from Python lists); rows are recycled, zeroed.
"""  # noqa: D205

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class TableRows:
    """One ``(rows, width)`` int32 array per group; one row per request.

    Args:
      widths: Block-table columns per group.
    """

    def __init__(self, widths: Sequence[int]) -> None:
        """No rows yet."""
        self.widths = list(widths)
        self._arrays = [np.zeros((0, w), np.int32) for w in self.widths]
        self._row: dict[str, int] = {}
        self._free: list[int] = []

    def _row_of(self, req_id: str) -> int:
        row = self._row.get(req_id)
        if row is None:
            if not self._free:
                have = len(self._arrays[0])
                grow = max(16, have)
                self._arrays = [
                    np.concatenate([m, np.zeros((grow, m.shape[1]), np.int32)])
                    for m in self._arrays
                ]
                self._free = list(range(have + grow - 1, have - 1, -1))
            row = self._row[req_id] = self._free.pop()
        return row

    def set(self, req_id: str, g: int, cols: Iterable[int], table: list[int]) -> None:
        """Copies ``table[j]`` for `cols` into `req_id`'s row of group `g`
        (columns past the width are left out: a batch refuses such a request).
        """  # noqa: D205
        row, width = self._row_of(req_id), self.widths[g]
        for j in cols:
            if j < width:
                self._arrays[g][row, j] = table[j]

    def zero(self, req_id: str, g: int, keep: int) -> None:
        """Zeroes the first `keep` columns of `req_id`'s row of group `g`."""
        self._arrays[g][self._row[req_id], :keep] = 0

    def release(self, req_id: str) -> None:
        """Zeroes `req_id`'s row in every group and recycles it."""
        row = self._row.pop(req_id, None)
        if row is not None:
            for m in self._arrays:
                m[row] = 0
            self._free.append(row)

    def gather(self, g: int, req_ids: Sequence[str]) -> np.ndarray:
        """Group `g`'s ``(len(req_ids), width)`` block table of a batch (a copy)."""
        index = np.fromiter((self._row[r] for r in req_ids), np.int64, len(req_ids))
        return self._arrays[g][index]
