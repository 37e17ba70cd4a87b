"""Block tables as arrays: one int32 array of rows per KV-cache group.

Block tables as arrays: rows of one int32 array per KV-cache group, kept in
step with the manager's per-request lists, so a batch's block table is one
gather (no per-step rebuild from Python lists; rows are recycled, zeroed), and
a batch's slot mappings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from jaxkv.sched._request import Request


class StepBlocks(NamedTuple):
    """A batch's block tables and slot mappings, one array per KV-cache group.

    Attributes:
      block_tables: ``(num_reqs, width)`` int32 per group, 0-padded.
      slot_mappings: ``(num_tokens,)`` int32 per group (``-1`` for Mamba
        groups, whose state is written through the block table).

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> m = jaxkv.KVCacheManager(plan)
      >>> r = jaxkv.Request("r", prompt=[1, 2, 3], max_new_tokens=1)
      >>> m.allocate(r, 3)
      True
      >>> out = m.step_blocks([(r, 3)])
      >>> out.slot_mappings[0].tolist(), out.block_tables[2][0, :2].tolist()
      ([32, 33, 34], [3, 0])
    """

    block_tables: list[np.ndarray]
    slot_mappings: list[np.ndarray]


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
        """Copies ``table[j]`` for `cols` into `req_id`'s row of group `g`.

        Columns past the width are left out: a batch refuses such a request.
        """
        row, width = self._row_of(req_id), self.widths[g]
        for j in cols:
            if j < width:
                self._arrays[g][row, j] = table[j]

    def zero(self, req_id: str, g: int, keep: int) -> None:
        """Zeroes the first `keep` columns of `req_id`'s row of group `g`."""
        self._arrays[g][self._row[req_id], :keep] = 0

    def zero_from(self, req_id: str, g: int, start: int) -> None:
        """Zeroes the columns from `start` on of `req_id`'s row of group `g`."""
        self._arrays[g][self._row[req_id], start:] = 0

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

    def batch_blocks(
        self,
        batch: Sequence[tuple[Request, int]],
        rows: Sequence[list[list[int]]],
        *,
        block_sizes: Sequence[int],
        is_mamba: Sequence[bool],
        max_model_len: int,
    ) -> StepBlocks:
        """A batch's block tables and slot mappings.

        A batch's block tables (gathered rows) and slot mappings (from each
        request's block list `rows`, its tokens from ``num_computed`` on).
        """
        num_tokens = sum(n for _, n in batch)
        req_ids = [req.req_id for req, _ in batch]
        tables, slots = [], []
        for g, width in enumerate(self.widths):
            longest = max((len(t[g]) for t in rows), default=0)
            if longest > width:
                req = next(
                    r
                    for (r, _), t in zip(batch, rows, strict=True)
                    if len(t[g]) > width
                )
                raise ValueError(
                    f"Request {req.req_id!r} holds {longest} blocks in group {g}, "
                    f"more than its block table's {width} columns "
                    f"(max_model_len={max_model_len})."
                )
            tables.append(self.gather(g, req_ids))
            slot = np.full(num_tokens, -1, np.int32)
            if not is_mamba[g]:
                bs = block_sizes[g]
                for (req, n), t in zip(batch, rows, strict=True):
                    if len(t[g]) * bs < req.num_computed + n:
                        raise ValueError(
                            f"step_blocks: request {req.req_id!r} holds blocks for "
                            f"{len(t[g]) * bs} tokens in group {g}; the step "
                            f"computes up to {req.num_computed + n} (allocate() "
                            "them first)."
                        )
                t0 = 0
                for (req, n), t in zip(batch, rows, strict=True):
                    ids, start = t[g], req.num_computed
                    if n == 1:  # a decode: no arrays
                        slot[t0] = ids[start // bs] * bs + start % bs
                    else:
                        pos = np.arange(start, start + n)
                        slot[t0 : t0 + n] = (
                            np.asarray(ids, np.int32)[pos // bs] * bs + pos % bs
                        )
                    t0 += n
            slots.append(slot)
        return StepBlocks(block_tables=tables, slot_mappings=slots)
