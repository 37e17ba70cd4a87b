"""``write_kv`` on the native XLA:CPU kernel (``jaxkv/_native/kv_write.cc``).

XLA:CPU runs a write as several kernels (K/V to the pool's element type,
slots to indices, the scatter), and each hand-off between them crosses
threads: on a small machine a 256-token write costs 3-5x NumPy's in-place
assignment of the same bytes, nearly all of it fixed cost. The kernel is
one custom call whose output aliases the pool operand: with the pool
donated it writes the new K/V rows in place, as raw bytes through the view's
byte offset and element strides, so word, typed and bits pools are one
case, and nothing pool-sized is converted or copied.

:func:`write_kv` takes it when asked for (``implementation="native"``)
and the view fits (:func:`native_write_unfit`). A custom call cannot be
split by XLA's SPMD partitioner: on a mesh, call it inside ``shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._native import target, unavailable_reason
from jaxkv.kv._checks import layer_index
from jaxkv.kv._raw_address import raw_address, raw_unfit
from jaxkv.plan import KVCacheView


def native_write_unfit(view: KVCacheView, value: jax.Array | None) -> str | None:
    """Why the native write cannot take this call (``None``: it can).

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> from jaxkv.kv._native_write import native_write_unfit
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> view = plan.views["layers.0.self_attn"]
      >>> native_write_unfit(view, None)
      'no value (MLA latents)'
    """
    if value is None or "head" not in view.axes:
        return "no value (MLA latents)"
    reason = raw_unfit(view)
    if reason is not None:
        return reason
    return unavailable_reason()


def native_write(
    pool: jax.Array,
    view: KVCacheView,
    key: jax.Array,
    value: jax.Array,
    slots: jax.Array,
    layer: object,
) -> jax.Array:
    """The pool with the tokens' K/V written (one custom call, in place)."""
    call = jax.ffi.ffi_call(
        target("kv_write"),
        jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={0: 0},
        vmap_method="sequential",  # a vmapped write: one call per batch entry
    )
    return call(
        pool,
        key.astype(view.dtype),
        value.astype(view.dtype),
        slots.astype(jnp.int32),
        layer_index(layer, view) if view.typed else jnp.int32(0),
        **raw_address(view),
    )
