"""Strided byte views over a flat pool, realised as windowed gathers and scatters.

A view is ``(offset, shape, element strides, dtype)`` over a pool that is one
flat array of integer *carrier* words (uint32 where alignment allows, else
uint16 or uint8). Accessing items (e.g. one token of one block) touches, per
item, ``L`` windows of contiguous words: the window is the longest run of
non-indexed dims that is dense in memory, the ``L`` loop positions enumerate
the other non-indexed dims. Everything is index arithmetic on the physical
array, so cost scales with the bytes touched, never with the pool.

Example (blocks-first HND view ``(N, 2, k, H, D)``, writing one token): the
window is one head's ``D`` values, ``L = 2 * H`` windows per token.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.plan import bits_dtype, granule, split_dims

_SCATTER_DIMS = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
)
_GATHER_DIMS = lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,)
)


@dataclasses.dataclass(frozen=True)
class AccessPlan:
    """How to touch the items of a view indexed on `indexed_dims` (all static)."""

    rest_dims: tuple[int, ...]  # non-indexed dims, logical order (data layout)
    loop_dims: tuple[int, ...]
    window_dims: tuple[int, ...]  # physical order, outermost first
    data_perm: tuple[int, ...]  # (n, *rest) -> (n, *loop, *window)
    loop_offsets: tuple[int, ...]  # word offset of each loop position
    index_strides: tuple[int, ...]  # word stride of each indexed dim
    offset_words: int
    window_elems: int
    window_words: int

    @property
    def num_loops(self) -> int:
        """Windows per item (``L``)."""
        return len(self.loop_offsets)


@functools.lru_cache(maxsize=4096)
def access_plan(
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    indexed_dims: tuple[int, ...],
    word: int,
) -> AccessPlan:
    """Plans an access of the view on `indexed_dims` over a pool of `word`-byte words.

    Raises:
      ValueError: If a window start or length is not a whole number of words.
    """
    if granule(offset, shape, strides, itemsize, indexed_dims) % word:
        raise ValueError(
            f"A view at byte {offset} with shape {shape} and strides {strides} is not "
            f"aligned to the pool's {word}-byte words."
        )
    loop, window = split_dims(shape, strides, indexed_dims)
    rest = tuple(d for d in range(len(shape)) if d not in indexed_dims)
    window_elems = math.prod(shape[d] for d in window)
    # Data arrives as (n, *rest); move loop dims, then window dims, after n.
    perm = (0, *(1 + rest.index(d) for d in (*loop, *window)))
    loop_offsets = tuple(
        sum(i * strides[d] * itemsize for i, d in zip(pos, loop, strict=True)) // word
        for pos in itertools.product(*(range(shape[d]) for d in loop))
    )
    return AccessPlan(
        rest_dims=rest,
        loop_dims=loop,
        window_dims=window,
        data_perm=perm,
        loop_offsets=loop_offsets,
        index_strides=tuple(strides[d] * itemsize // word for d in indexed_dims),
        offset_words=offset // word,
        window_elems=window_elems,
        window_words=window_elems * itemsize // word,
    )


def _starts(
    plan: AccessPlan,
    indices: Sequence[jax.Array],
    limits: Sequence[int],
    pool_shape: Sequence[int],
) -> jax.Array:
    """Start of every window, as word offsets or (row, word) pairs.

    Start of every window, ``(n * L, 1)`` word offsets (a flat pool) or
    ``(n * L, 2)`` ``(row, word)`` pairs (a row pool ``(rows, R)``, where each
    block lies in one row: no offset past int32 is ever formed).

    An item is invalid if any index is negative (padding) or past its dim; its
    windows start past the pool's end, so a FILL_OR_DROP scatter drops them and
    a gather fills them. The first index is the block id.
    """
    valid = jnp.ones(indices[0].shape, jnp.bool_)
    idx32 = []
    for idx, limit in zip(indices, limits, strict=True):
        idx = idx.astype(jnp.int32)
        valid = valid & (idx >= 0) & (idx < limit)
        idx32.append(jnp.where(valid, idx, 0))
    loops = jnp.asarray(np.asarray(plan.loop_offsets, np.int32))
    if len(pool_shape) == 1:
        base = jnp.full(indices[0].shape, plan.offset_words, jnp.int32)
        for idx, stride in zip(idx32, plan.index_strides, strict=True):
            base = base + idx * jnp.int32(stride)
        starts = base[:, None] + loops[None, :]
        starts = jnp.where(valid[:, None], starts, jnp.int32(pool_shape[0]))
        return starts.reshape(-1, 1)
    rows, width = pool_shape
    row0, col0 = divmod(plan.offset_words, width)
    step = plan.index_strides[0]
    block = idx32[0]
    if step % width == 0:
        row = row0 + block * jnp.int32(step // width)
        col = jnp.full(block.shape, col0, jnp.int32)
    else:  # a row holds `per` blocks (row_fits checked it at planning)
        per = width // step
        row = row0 + block // jnp.int32(per)
        col = col0 + (block % jnp.int32(per)) * jnp.int32(step)
    for idx, stride in zip(idx32[1:], plan.index_strides[1:], strict=True):
        col = col + idx * jnp.int32(stride)
    row = jnp.where(valid, row, jnp.int32(rows))
    n, num_loops = block.shape[0], loops.shape[0]
    cols = col[:, None] + loops[None, :]
    rows_of = jnp.broadcast_to(row[:, None], (n, num_loops))
    return jnp.stack([rows_of.reshape(-1), cols.reshape(-1)], axis=1)


_ROW_SCATTER = lax.ScatterDimensionNumbers(
    update_window_dims=(1,),
    inserted_window_dims=(0,),
    scatter_dims_to_operand_dims=(0, 1),
)
_ROW_GATHER = lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0, 1)
)


def to_bits(x: jax.Array) -> jax.Array:
    """Same-width reinterpretation as unsigned integers.

    Data is moved (transposed, concatenated, sliced) only as integers: XLA:CPU
    may move bf16/fp8 through float32 with denormals flushed to zero, which
    would change bytes that another layer's view reads (an overlay).
    """
    target = bits_dtype(x.dtype)
    return x if x.dtype == target else lax.bitcast_convert_type(x, target)


def from_bits(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """Inverse of :func:`to_bits` (the last step of a read).

    Note: XLA:CPU materialises bf16 values through float32 with denormals off,
    so a bf16 *subnormal* read back as a float comes out as a signed zero
    (pools themselves always keep every bit).
    """
    return x if x.dtype == np.dtype(dtype) else lax.bitcast_convert_type(x, dtype)


def to_words(x: jax.Array, word_dtype: np.dtype) -> jax.Array:
    """Bitcasts ``(m, e)`` elements to ``(m, q)`` carrier words."""
    src, dst = np.dtype(x.dtype).itemsize, np.dtype(word_dtype).itemsize
    m = x.shape[0]
    if src == dst:
        return lax.bitcast_convert_type(x, word_dtype)
    if src < dst:
        x = x.reshape(m, -1, dst // src)
        return lax.bitcast_convert_type(x, word_dtype)
    return lax.bitcast_convert_type(x, word_dtype).reshape(m, -1)


def from_words(words: jax.Array, dtype: np.dtype) -> jax.Array:
    """Bitcasts ``(m, q)`` carrier words to ``(m, e)`` elements of `dtype`."""
    src, dst = np.dtype(words.dtype).itemsize, np.dtype(dtype).itemsize
    m = words.shape[0]
    if src == dst:
        return lax.bitcast_convert_type(words, dtype)
    if src > dst:
        return lax.bitcast_convert_type(words, dtype).reshape(m, -1)
    return lax.bitcast_convert_type(words.reshape(m, -1, dst // src), dtype)


def scatter_items(
    pool: jax.Array,
    plan: AccessPlan,
    indices: Sequence[jax.Array],
    limits: Sequence[int],
    data: jax.Array,
) -> jax.Array:
    """Writes ``data (n, *rest)`` at the items named by `indices`; returns the pool.

    Invalid items (negative or out-of-range indices) write nothing.
    """
    n = data.shape[0]
    starts = _starts(plan, indices, limits, pool.shape)
    updates = jnp.transpose(to_bits(data), plan.data_perm).reshape(
        n * plan.num_loops, -1
    )
    words = to_words(updates, pool.dtype)
    return lax.scatter(
        pool,
        starts,
        words,
        _SCATTER_DIMS if pool.ndim == 1 else _ROW_SCATTER,
        mode=lax.GatherScatterMode.FILL_OR_DROP,
    )


def gather_items(
    pool: jax.Array,
    plan: AccessPlan,
    indices: Sequence[jax.Array],
    limits: Sequence[int],
    shape: Sequence[int],
    dtype: np.dtype,
) -> jax.Array:
    """Reads the items named by `indices` as ``(n, *rest)`` in logical order.

    Returns the raw bits (unsigned integers as wide as `dtype`); convert with
    :func:`from_bits` after any slicing. Invalid items read as all-ones bits
    (NaN for floats).
    """
    n = indices[0].shape[0]
    starts = _starts(plan, indices, limits, pool.shape)
    words = lax.gather(
        pool,
        starts,
        _GATHER_DIMS if pool.ndim == 1 else _ROW_GATHER,
        slice_sizes=(plan.window_words,) if pool.ndim == 1 else (1, plan.window_words),
        mode=lax.GatherScatterMode.FILL_OR_DROP,
        fill_value=np.iinfo(pool.dtype).max,
    )
    elems = from_words(words, bits_dtype(dtype))
    moved = (n, *(shape[d] for d in (*plan.loop_dims, *plan.window_dims)))
    elems = elems.reshape(moved)
    return jnp.transpose(elems, tuple(int(i) for i in np.argsort(plan.data_perm)))
