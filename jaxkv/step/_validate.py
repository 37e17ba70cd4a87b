"""Host checks of a step's arrays before they are packed.

Nothing wraps, nothing reads keys it should not, every error names the argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv._util import host_int_array

_INT32 = np.iinfo(np.int32)


def _ints(value: object, name: str, ndim: int) -> np.ndarray:
    arr = host_int_array(value, name)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}.")
    # Only types wider than int32 can hold values that would wrap.
    if (
        arr.dtype.itemsize >= 4
        and arr.dtype != np.int32
        and arr.size
        and (arr.max() > _INT32.max or arr.min() < _INT32.min)
    ):
        raise ValueError(
            f"{name} holds values past the int32 range (they would wrap around)."
        )
    return arr


def validate_step(
    *,
    block_sizes: Sequence[int],
    is_mamba: Sequence[bool],
    num_blocks: int,
    query_start_loc: object,
    seq_lens: object,
    positions: object,
    block_tables: Sequence[object],
    slot_mappings: Sequence[object],
    logits_indices: object | None = None,
    group_kinds: Sequence[str] | None = None,
) -> None:
    """Checks a step's host arrays against each other and the pools.

    - ``query_start_loc`` starts at 0 and never decreases;
    - ``seq_lens`` are at least each request's query length (a query is the
      tail of its sequence);
    - ``positions`` and every slot mapping have one entry per token;
    - every block table has a row per request and enough columns for its
      sequence, with ids in ``[0, num_blocks)`` in those columns (0, the null
      block, is allowed: a window may have given a block back);
    - logits indices are ascending token indices;
    - with `group_kinds` (:attr:`KVCachePlan.group_kinds`), each token's slot
      in an attention group is ``-1`` (not written) or its own: in its own
      request's block for its position (``seq_len - query_len + i``), never
      the null block; a ``"full"`` group's context holds no null block.

    Raises:
      TypeError: If an array is not integer-typed.
      ValueError: Naming the argument, the request or group, what was expected
        and what came.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> jaxkv.validate_step(block_sizes=[16], is_mamba=[False], num_blocks=8,
      ...     query_start_loc=np.array([0, 3]), seq_lens=np.array([20]),
      ...     positions=np.arange(17, 20), block_tables=[np.array([[1]])],
      ...     slot_mappings=[np.array([33, 34, 35])])
      Traceback (most recent call last):
      ...
      ValueError: block_tables[0] has 1 columns; request 0 needs 2 for seq_len 20 (block size 16).
    """  # noqa: E501
    qsl, seq, num_tokens = _check_requests(query_start_loc, seq_lens, positions)
    kinds: tuple[str, ...] | None = None
    if group_kinds is not None:
        kinds = tuple(group_kinds)
        if len(kinds) != len(block_sizes) or any(
            (k == "mamba") != bool(m) for k, m in zip(kinds, is_mamba, strict=False)
        ):
            raise ValueError(
                f"group_kinds={kinds!r} does not match is_mamba={tuple(is_mamba)!r}."
            )
    if len(block_tables) != len(block_sizes) or len(slot_mappings) != len(block_sizes):
        raise ValueError(
            f"Expected {len(block_sizes)} block tables and slot mappings (one per "
            f"KV-cache group), got {len(block_tables)} and {len(slot_mappings)}."
        )
    for g, (bs, mamba) in enumerate(zip(block_sizes, is_mamba, strict=True)):
        _check_group(
            g,
            _ints(block_tables[g], f"block_tables[{g}]", 2),
            _ints(slot_mappings[g], f"slot_mappings[{g}]", 1),
            block_size=bs,
            is_mamba=mamba,
            kind=None if kinds is None else kinds[g],
            num_blocks=num_blocks,
            qsl=qsl,
            seq=seq,
        )
    if logits_indices is not None:
        _check_logits_indices(_ints(logits_indices, "logits_indices", 1), num_tokens)


def _check_requests(
    query_start_loc: object, seq_lens: object, positions: object
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(query_start_loc, seq_lens, num_tokens)`` checked against each other."""
    qsl = _ints(query_start_loc, "query_start_loc", 1)
    _check_query_start_loc(qsl)
    q_lens = np.diff(qsl)
    num_reqs, num_tokens = q_lens.size, int(qsl[-1])
    seq = _ints(seq_lens, "seq_lens", 1)
    if seq.shape != (num_reqs,):
        raise ValueError(f"seq_lens.shape={seq.shape}, expected ({num_reqs},).")
    short = np.flatnonzero(seq < q_lens)
    if short.size:
        r = int(short[0])
        raise ValueError(
            f"seq_lens[{r}]={int(seq[r])} is shorter than request {r}'s query of "
            f"{int(q_lens[r])} tokens (a query is the tail of its sequence)."
        )
    pos = _ints(positions, "positions", 1)
    if pos.shape != (num_tokens,):
        raise ValueError(f"positions.shape={pos.shape}, expected ({num_tokens},).")
    return qsl, seq, num_tokens


def _check_group(
    g: int,
    table: np.ndarray,
    slots: np.ndarray,
    *,
    block_size: int,
    is_mamba: bool,
    kind: str | None,
    num_blocks: int,
    qsl: np.ndarray,
    seq: np.ndarray,
) -> None:
    """Group `g`'s block table and slot mapping against the requests."""
    bs, q_lens = block_size, np.diff(qsl)
    num_reqs, num_tokens = q_lens.size, int(qsl[-1])
    if slots.shape != (num_tokens,):
        raise ValueError(
            f"slot_mappings[{g}].shape={slots.shape}, expected ({num_tokens},)."
        )
    if table.shape[0] != num_reqs:
        raise ValueError(
            f"block_tables[{g}] has {table.shape[0]} rows, expected one per "
            f"request ({num_reqs})."
        )
    need = -(-seq // bs) if not is_mamba else np.maximum(seq - 1, 0) // bs + 1
    if num_reqs and int(need.max()) > table.shape[1]:
        r = int(np.argmax(need))
        raise ValueError(
            f"block_tables[{g}] has {table.shape[1]} columns; request {r} needs "
            f"{int(need[r])} for seq_len {int(seq[r])} (block size {bs})."
        )
    context = np.arange(table.shape[1])[None, :] < need[:, None]
    bad = np.argwhere(((table < 0) | (table >= num_blocks)) & context)
    if bad.size:
        r, c = (int(i) for i in bad[0])
        raise ValueError(
            f"block_tables[{g}][{r}, {c}] is {int(table[r, c])}, outside "
            f"[0, {num_blocks}) in request {r}'s context."
        )
    if kind == "full":
        null = np.argwhere((table == 0) & context)
        if null.size:
            r, c = (int(i) for i in null[0])
            raise ValueError(
                f"block_tables[{g}][{r}, {c}] is the null block in request "
                f"{r}'s context (group {g} keeps every block): the request's "
                "blocks were freed or never allocated."
            )
    if kind in ("full", "window") and num_tokens:
        _check_own_slots(g, table, slots, bs, qsl, seq)


def _check_own_slots(
    g: int,
    table: np.ndarray,
    slots: np.ndarray,
    bs: int,
    qsl: np.ndarray,
    seq: np.ndarray,
) -> None:
    """Each written slot is its token's own: its request's block for its position."""
    q_lens = np.diff(qsl)
    num_tokens = int(qsl[-1])
    # Each token's request and position in its sequence.
    tok_req = np.repeat(np.arange(q_lens.size), q_lens)
    tok_pos = (
        np.arange(num_tokens)
        - np.repeat(qsl[:-1], q_lens)
        + np.repeat(seq.astype(np.int64) - q_lens, q_lens)
    )
    block = table[tok_req, tok_pos // bs].astype(np.int64)
    want = block * bs + tok_pos % bs
    wrong = (slots != -1) & ((slots != want) | (block == 0))
    if wrong.any():
        t = int(np.argmax(wrong))
        r, p = int(tok_req[t]), int(tok_pos[t])
        raise ValueError(
            f"slot_mappings[{g}][{t}] is {int(slots[t])} (block "
            f"{int(slots[t]) // bs}); request {r}'s token at position {p} "
            f"belongs in block {int(block[t])} (slot {int(want[t])})"
            + (
                ", the null block: its block was never allocated."
                if block[t] == 0
                else "."
            )
        )


def _check_query_start_loc(qsl: np.ndarray) -> None:
    if qsl.size == 0 or qsl[0] != 0:
        raise ValueError(
            "query_start_loc must start at 0 (one more entry than requests), got "
            f"{qsl[:4].tolist()}."
        )
    drops = np.flatnonzero(np.diff(qsl) < 0)
    if drops.size:
        i = int(drops[0]) + 1
        raise ValueError(
            f"query_start_loc must not decrease: entry {i} is {int(qsl[i])} after "
            f"{int(qsl[i - 1])}."
        )


def _check_logits_indices(idx: np.ndarray, num_tokens: int) -> None:
    bad = np.flatnonzero((idx < 0) | (idx >= num_tokens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"logits_indices[{i}] = {int(idx[i])} is outside the batch of "
            f"{num_tokens} tokens."
        )
    steps = np.flatnonzero(np.diff(idx) <= 0)
    if steps.size:
        i = int(steps[0]) + 1
        raise ValueError(
            f"logits_indices must be strictly ascending; logits_indices[{i}] = "
            f"{int(idx[i])} follows {int(idx[i - 1])}."
        )


def validate_query_start_loc(query_start_loc: object) -> None:
    """Host-side check: a 1-D integer array starting at 0 that never decreases.

    Raises:
      ValueError: Naming the first bad entry.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> jaxkv.step.validate_query_start_loc(np.array([0, 4, 3]))
      Traceback (most recent call last):
      ...
      ValueError: query_start_loc must not decrease: entry 2 is 3 after 4.
    """
    _check_query_start_loc(_ints(query_start_loc, "query_start_loc", 1))


def validate_logits_indices(
    logits_indices: object,
    query_start_loc: object,
    *,
    buffer_size: int | None = None,
) -> None:
    """Host-side check of a step's logits indices against its batch.

    The same check :func:`validate_step` makes.

    Raises:
      ValueError: If `query_start_loc` is not a non-decreasing sequence from 0,
        an index is outside the batch or not strictly ascending, or there are
        more indices than `buffer_size`.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> jaxkv.step.validate_logits_indices(np.array([3, 9]), np.array([0, 4, 10]))
      >>> jaxkv.step.validate_logits_indices(np.array([3, 10]), np.array([0, 4, 10]))
      Traceback (most recent call last):
      ...
      ValueError: logits_indices[1] = 10 is outside the batch of 10 tokens.
    """
    qsl = _ints(query_start_loc, "query_start_loc", 1)
    _check_query_start_loc(qsl)
    idx = _ints(logits_indices, "logits_indices", 1)
    _check_logits_indices(idx, int(qsl[-1]))
    if buffer_size is not None and idx.size > buffer_size:
        raise ValueError(
            f"{idx.size} logits indices exceed the staging buffer of {buffer_size}."
        )
