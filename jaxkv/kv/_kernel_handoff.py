"""Kernel hand-off: a layer's cache as the array a kernel takes, and back.

A typed pool's layer slot is already the kernel's array; :func:`kernel_cache`
hands it out as a pure slice/reshape and :func:`put_kernel_cache` puts a
write-fused kernel's result back, aliased under donation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Int

from jaxkv.kv._checks import Pools, _num_slots, check_fits, check_layer, layer_index
from jaxkv.kv._ops import _replace
from jaxkv.kv._write_log import record
from jaxkv.plan import KVCacheView, slot_shape


def _typed_view(view: object, name: str) -> KVCacheView:
    if not isinstance(view, KVCacheView) or not view.typed:
        raise TypeError(
            f"{name}: needs the view of a typed pool (plan with storage='typed' or "
            f"'stacked'), got {view!r:.80}; a word pool has no array a kernel "
            "could take in place."
        )
    return view


def kernel_cache(
    pools: Pools,
    view: KVCacheView,
    *,
    layer: Int[ArrayLike, ""] | None = None,
    shape: tuple[int, ...] | None = None,
) -> jax.Array:
    """A layer's cache as the array a kernel takes: its typed pool's slot.

    The slot as the pool holds it (``(num_blocks, block_size, H, D + Dv)`` for
    a fused LBNHC layer; ``(num_blocks, block_size, 2H/p, p, D)`` for a
    backend that packs K/V heads, such as ``RPA_V3``), reshaped to `shape` if
    given: the pool itself for a one-slot pool (``storage="typed"``) whose
    shape is `shape`, a reshape of it otherwise, an index into it for a
    stacked one; never a conversion. Call it inside the jitted step; a bits
    pool (``pool_dtype="bits"``) gives the bits. XLA:CPU copies a *reshaped*
    cache that a kernel carries through a loop, so plan with the kernel's
    backend (its shape) rather than reshaping.

    Raises:
      TypeError: If the view reads a word pool.
      ValueError: If `shape` holds another number of elements.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2),
      ...                        num_blocks=4, storage="typed")
      >>> pools = plan.allocate()
      >>> jaxkv.kernel_cache(pools, plan.views["layers.1.self_attn"]).shape
      (4, 16, 2, 64)
    """
    view = _typed_view(view, "kernel_cache")
    check_fits(pools, view)
    check_layer(layer, view, pools, "kernel_cache")
    pool = pools[view.pool]
    phys = slot_shape(view)
    if _num_slots(pool, view) == 1 and layer is None:
        if shape is not None and tuple(shape) == tuple(pool.shape):
            return pool  # the pool is the kernel's array
        slot = pool.reshape(phys)
    else:
        slots = pool.reshape((-1, *phys))
        slot = lax.dynamic_index_in_dim(
            slots, layer_index(layer, view), 0, keepdims=False
        )
    if shape is None:
        return slot
    if int(np.prod(shape)) != int(np.prod(phys)):
        raise ValueError(
            f"kernel_cache: shape={tuple(shape)} holds {int(np.prod(shape))} "
            f"elements, the layer's cache {phys} holds {int(np.prod(phys))}."
        )
    return slot.reshape(shape)


def put_kernel_cache(
    pools: Pools,
    view: KVCacheView,
    cache: jax.Array,
    *,
    layer: Int[ArrayLike, ""] | None = None,
) -> Pools:
    """Puts back the cache a write-fused kernel returned for a layer.

    The inverse of :func:`kernel_cache`: a reshape for a one-slot pool, an
    in-place update of the slot for a stacked one (inside a jit that donates
    the pools neither copies the pool).

    Raises:
      TypeError: If the view reads a word pool.
      ValueError: If `cache` has another size or dtype than the slot.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2),
      ...                        num_blocks=4, storage="stacked")
      >>> pools, view = plan.allocate(), plan.views["layers.1.self_attn"]
      >>> cache = jaxkv.kernel_cache(pools, view)
      >>> pools = jaxkv.put_kernel_cache(pools, view, cache.at[1, 0].set(1.0))
      >>> k, v = jaxkv.gather_kv_pages(pools, view, jnp.array([[1]]))
      >>> float(k[0, 0, 0].sum()), float(v[0, 0, 0].sum())
      (64.0, 64.0)
    """
    view = _typed_view(view, "put_kernel_cache")
    check_fits(pools, view)
    check_layer(layer, view, pools, "put_kernel_cache")
    pool = pools[view.pool]
    phys = slot_shape(view)
    cache = jnp.asarray(cache)
    if int(np.prod(cache.shape)) != int(np.prod(phys)) or cache.dtype != pool.dtype:
        raise ValueError(
            f"put_kernel_cache: cache is {cache.dtype}{list(cache.shape)}, expected "
            f"{int(np.prod(phys))} elements of {pool.dtype} (the layer's cache "
            f"{phys})."
        )
    if _num_slots(pool, view) == 1 and layer is None:
        out = _replace(pools, view.pool, cache.reshape(pool.shape))
    else:
        slots = pool.reshape((-1, *phys))
        new = lax.dynamic_update_index_in_dim(
            slots, cache.reshape(phys), layer_index(layer, view), 0
        )
        out = _replace(pools, view.pool, new.reshape(pool.shape))
    record("put_kernel_cache", view, layer, pools, out)  # ServingLoop's check
    return out
