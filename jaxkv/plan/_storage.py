"""Storage geometry: carrier words, access granules, dense slots, bit dtypes.

Static arithmetic on a view's ``(offset, shape, strides, itemsize)`` that
planning the pools needs (``_pools``) and the jitted reads and writes reuse
(``jaxkv.kv``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxkv.plan._views import KVCacheView

_CARRIERS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def carrier_dtype(width: int) -> np.dtype:
    """The unsigned integer dtype of `width` bytes used as a pool's word."""
    return _CARRIERS[width]


def granule(
    offset: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    indexed_dims: Sequence[int],
) -> int:
    """Largest byte alignment shared by every window start and length of an access."""
    loop, window = split_dims(shape, strides, indexed_dims)
    window_bytes = math.prod(shape[d] for d in window) * itemsize
    values = [offset, window_bytes]
    values += [strides[d] * itemsize for d in (*indexed_dims, *loop) if shape[d] > 1]
    return math.gcd(*values)


def split_dims(
    shape: Sequence[int], strides: Sequence[int], indexed_dims: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Splits non-indexed dims into (loop dims, window dims in physical order)."""
    rest = [d for d in range(len(shape)) if d not in indexed_dims]
    # Physical order: by stride, outermost first. Size-1 dims carry no address
    # and are kept out of the window so a tie in strides cannot misplace them.
    ordered = sorted(range(len(shape)), key=lambda d: -strides[d])
    window: list[int] = []
    dense = 1
    for d in reversed(ordered):
        if shape[d] == 1:
            continue
        if d in indexed_dims or strides[d] != dense:
            break
        window.insert(0, d)
        dense *= shape[d]
    loop = tuple(d for d in rest if d not in window)
    return loop, tuple(window)


def row_fits(
    offset: int,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    block_dim: int,
    row_bytes: int,
) -> bool:
    """Whether a view's blocks each lie inside one row of `row_bytes`.

    A row pool, see :func:`_starts`: the block stride a multiple or a divisor of the
    row, and one block's bytes never crossing a row's end.
    """
    step = strides[block_dim] * itemsize
    span = itemsize + itemsize * sum(
        (n - 1) * st
        for d, (n, st) in enumerate(zip(shape, strides, strict=True))
        if d != block_dim
    )
    start = offset % row_bytes
    if step % row_bytes == 0:
        return start + span <= row_bytes
    if row_bytes % step == 0:
        per = row_bytes // step
        return start + (min(per, shape[block_dim]) - 1) * step + span <= row_bytes
    return False


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype as wide as `dtype`."""
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


def physical_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Logical dims from outermost to innermost in memory (by decreasing stride)."""
    return tuple(sorted(range(len(shape)), key=lambda d: -strides[d]))


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the strides lay `shape` out contiguously in some axis order."""
    acc = 1
    for d in reversed(physical_order(shape, strides)):
        if shape[d] == 1:
            continue
        if strides[d] != acc:
            return False
        acc *= shape[d]
    return True


def physical_shape(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """`shape` in physical order: the shape of one dense slot seen as an array."""
    return tuple(int(shape[d]) for d in physical_order(shape, strides))


def storage_dtype(dtype: np.dtype, bits: bool) -> np.dtype:
    """The dtype a typed pool of `dtype` elements holds (`bits`: same-width uints)."""
    return bits_dtype(dtype) if bits else np.dtype(dtype)


def slot_shape(view: KVCacheView) -> tuple[int, ...]:
    """The array shape of one layer slot holding `view` in a typed pool.

    Its physical shape without unit dims, or ``(N, B, 2H/p, p, D)`` for a packing
    backend (the kernel's own shape, unit dims kept).
    """
    phys = physical_shape(view.shape, view.strides)
    if view.kv_packing and len(phys) == 4 and phys == view.shape:
        n, b, h, c = phys
        p = view.kv_packing
        return (n, b, 2 * h // p, p, c // 2)
    # Unit dims (one local KV head, say) are left out: XLA:CPU gives a unit
    # dim of a loop-carried pool a layout of its own choosing and copies the
    # pool into it (measured under shard_map with one KV head per rank).
    return tuple(d for d in phys if d != 1) or (1,)
