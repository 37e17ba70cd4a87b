"""Typed pools: an element-typed array per pool, layers stacked on its first axis.

A typed pool holds ``L`` layer slots, each one dense layer cache of
``prod(slot)`` elements: ``(L, *slot)`` when layers are stacked, the slot
itself (the array a kernel takes) when it holds one layer. A view of it
(``view.layer`` set) is
dense over one slot in some axis order (its *physical order*, the dims by
decreasing stride), so every access is a reshape of the pool to
``(L, *physical shape)`` followed by one gather or scatter indexed by
``(layer, block, token, ...)``: no flat index (no int32 limit on the pool
size), no carrier words (a kernel gets the cache array it expects), and the
layer index may be a traced value (``lax.scan`` over layers).

The pool holds either the view's dtype (``element``) or the unsigned integers
of the same width (``bits``): XLA:CPU converts a bf16 scatter through float32
over the whole pool (a cost of the pool's size, where the same uint16
scatter costs the tokens': ``benchmarks/bench_kv_write.py``), so on CPU
narrow floats are stored as bits; on accelerators the native dtype is what
kernels read.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.kv._strided import from_bits, to_bits
from jaxkv.plan import (
    KVCacheView,
    physical_order,
    physical_shape,
)


def _as_slots(
    pool: jax.Array, shape: Sequence[int], strides: Sequence[int]
) -> jax.Array:
    return pool.reshape((-1, *physical_shape(shape, strides)))


def _index_columns(
    layer: jax.Array,
    indices: Sequence[jax.Array],
    limits: Sequence[int],
    num_layers: int,
) -> jax.Array:
    """``(n, 1 + k)`` int32 starts; an invalid item's layer is out of bounds.

    ``(n, 1 + k)`` int32 starts; an invalid item's layer is ``num_layers``
    (out of bounds: a FILL_OR_DROP scatter drops it, a gather fills it).
    """
    n = indices[0].shape[0]
    layer = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (n,))
    valid = (layer >= 0) & (layer < num_layers)
    for idx, limit in zip(indices, limits, strict=True):
        valid = valid & (idx >= 0) & (idx < limit)
    layer = jnp.where(valid, layer, jnp.int32(num_layers))
    cols = [layer, *(jnp.where(valid, i, 0).astype(jnp.int32) for i in indices)]
    return jnp.stack(cols, axis=1)


def _dims(
    shape: Sequence[int], strides: Sequence[int], indexed: Sequence[int]
) -> tuple[tuple[int, ...], list[int], list[int]]:
    order = physical_order(shape, strides)
    operand = tuple(1 + order.index(d) for d in indexed)
    rest_logical = [d for d in range(len(shape)) if d not in indexed]
    rest_physical = [d for d in order if d not in indexed]
    return operand, rest_logical, rest_physical


def scatter(
    pool: jax.Array,
    view: KVCacheView,
    *,
    layer: jax.Array,
    indexed: Sequence[int],
    indices: Sequence[jax.Array],
    data: jax.Array,
) -> jax.Array:
    """Writes ``data (n, *rest)`` at items ``indices`` of `view`.

    Writes ``data (n, *rest)`` (logical order) at the items ``indices`` of the
    logical dims `indexed` of `view`, in layer slot `layer`; returns the pool.

    Items with an index out of range (negative included) or a layer outside
    the pool write nothing.
    """
    shape, strides, dtype = view.shape, view.strides, view.dtype
    slots = _as_slots(pool, shape, strides)
    operand, rest_logical, rest_physical = _dims(shape, strides, indexed)
    perm = (0, *(1 + rest_logical.index(d) for d in rest_physical))
    updates = jnp.transpose(data.astype(dtype), perm)
    if updates.dtype != slots.dtype:
        updates = to_bits(updates)
    starts = _index_columns(layer, indices, [shape[d] for d in indexed], slots.shape[0])
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(1, 1 + len(rest_physical))),
        inserted_window_dims=tuple(sorted((0, *operand))),
        scatter_dims_to_operand_dims=(0, *operand),
    )
    out = lax.scatter(
        slots, starts, updates, dnums, mode=lax.GatherScatterMode.FILL_OR_DROP
    )
    return out.reshape(pool.shape)


def gather(
    pool: jax.Array,
    view: KVCacheView,
    *,
    layer: jax.Array,
    indexed: Sequence[int],
    indices: Sequence[jax.Array],
) -> jax.Array:
    """Reads the items ``indices`` of dims `indexed` as ``(n, *rest)``.

    In logical order, in the pool's storage dtype (convert with
    :func:`from_bits`; a no-op for native pools). Invalid items read as NaN
    (all-ones bits for bits pools and integers).
    """
    shape, strides = view.shape, view.strides
    slots = _as_slots(pool, shape, strides)
    operand, rest_logical, rest_physical = _dims(shape, strides, indexed)
    starts = _index_columns(layer, indices, [shape[d] for d in indexed], slots.shape[0])
    collapsed = tuple(sorted((0, *operand)))
    sizes = tuple(1 if d in collapsed else slots.shape[d] for d in range(slots.ndim))
    dnums = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(1, 1 + len(rest_physical))),
        collapsed_slice_dims=collapsed,
        start_index_map=(0, *operand),
    )
    fill = (
        np.nan
        if jnp.issubdtype(slots.dtype, jnp.inexact)
        else np.iinfo(slots.dtype).max
    )
    out = lax.gather(
        slots,
        starts,
        dnums,
        sizes,
        mode=lax.GatherScatterMode.FILL_OR_DROP,
        fill_value=fill,
    )
    perm = (0, *(1 + rest_physical.index(d) for d in rest_logical))
    return jnp.transpose(out, perm)


def read_slot(pool: jax.Array, view: KVCacheView, *, layer: jax.Array) -> jax.Array:
    """One layer slot in its logical shape and dtype (a copy)."""
    shape, strides, dtype = view.shape, view.strides, view.dtype
    slots = _as_slots(pool, shape, strides)
    slot = lax.dynamic_index_in_dim(slots, layer, 0, keepdims=False)
    order = physical_order(shape, strides)
    return from_bits(jnp.transpose(slot, tuple(np.argsort(order))), dtype)
