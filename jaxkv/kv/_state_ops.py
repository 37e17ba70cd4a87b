"""Mamba states, block zeroing and whole-view reads through layer views.

Jitted, pool donated where they write; a Mamba state lives at one block per
request, addressed through the group's block table.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Int, Shaped

from jaxkv.kv import _typed as typed
from jaxkv.kv._checks import (
    Pools,
    _check_dtype_supported,
    _check_view,
    _checks_host_ids,
    _device_ids,
    layer_index,
)
from jaxkv.kv._ops import _plan, _replace
from jaxkv.kv._strided import from_bits, gather_items, scatter_items
from jaxkv.plan import KVCacheView, LayerView, MambaView


@_checks_host_ids("block_ids", view=MambaView, records=True)
@functools.partial(jax.jit, donate_argnums=0)
def write_mamba_state(
    pools: Pools,
    view: MambaView,
    block_ids: Int[ArrayLike, " n"],
    states: Sequence[Shaped[ArrayLike, "n ..."]],
) -> Pools:
    """Writes Mamba states for `block_ids`; the pools are donated.

    Args:
      pools: The pool arrays (donated).
      view: The layer's :class:`MambaView` (static).
      block_ids: ``(n,)`` int32 block ids; negative or out-of-range ids write
        nothing. Ids must be unique: which of two writes to one id wins is
        unspecified (GPU scatters do not keep order).
      states: One ``(n, *shapes[i])`` array per state.

    Returns:
      The new pools.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4)
      >>> pools, views = plan.allocate(), plan.views
      >>> m = views["layers.2.mixer"]
      >>> ids = jnp.array([2], jnp.int32)
      >>> pools = jaxkv.write_mamba_state(pools, m, ids,
      ...     [jnp.full((1, 3, 128), 1.5), jnp.full((1, 4, 32, 16), 2.0)])
      >>> conv, ssm = jaxkv.read_mamba_state(pools, m, ids)
      >>> float(conv.sum()), float(ssm[0, 3, 31, 15])
      (576.0, 2.0)
    """
    _check_view(view, MambaView, "write_mamba_state")
    for s in view.states:
        _check_dtype_supported(s)
    ids = _device_ids(block_ids, "block_ids")
    if len(states) != len(view.states):
        raise ValueError(
            f"states has {len(states)} arrays, expected {len(view.states)} (one per "
            "Mamba state)."
        )
    pool = pools[view.pool]
    for i, (state_view, data) in enumerate(zip(view.states, states, strict=True)):
        data = jnp.asarray(data)
        expected = (ids.shape[0], *state_view.shape[1:])
        if tuple(data.shape) != expected:
            raise ValueError(
                f"states[{i}].shape={tuple(data.shape)}, expected {expected}."
            )
        plan = _plan(state_view, (0,))
        pool = scatter_items(
            pool, plan, (ids,), (state_view.num_blocks,), data.astype(state_view.dtype)
        )
    return _replace(pools, view.pool, pool)


@_checks_host_ids("block_ids", view=MambaView)
@jax.jit
def read_mamba_state(
    pools: Pools, view: MambaView, block_ids: Int[ArrayLike, " n"]
) -> tuple[jax.Array, ...]:
    """Reads the Mamba states of `block_ids`: one ``(n, *shapes[i])`` array each.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4)
      >>> pools, views = plan.allocate(), plan.views
      >>> [s.shape for s in jaxkv.read_mamba_state(pools, views["layers.5.mixer"],
      ...                                          jnp.array([1, 2], jnp.int32))]
      [(2, 3, 128), (2, 4, 32, 16)]
    """
    _check_view(view, MambaView, "read_mamba_state")
    for s in view.states:
        _check_dtype_supported(s)
    ids = _device_ids(block_ids, "block_ids")
    return tuple(
        from_bits(
            gather_items(
                pools[s.pool], _plan(s, (0,)), (ids,), (s.num_blocks,), s.shape, s.dtype
            ),
            s.dtype,
        )
        for s in view.states
    )


@_checks_host_ids("block_ids")
@functools.partial(jax.jit, donate_argnums=0)
def zero_blocks(
    pools: Pools, views: Sequence[LayerView], block_ids: Int[ArrayLike, " n"]
) -> Pools:
    """Zeroes every byte each view owns for `block_ids` (new blocks); pools donated.

    Ids are in each view's block space: expand manager ids with
    :meth:`AttentionGroup.map_to_kernel_block_table` for kernel views.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4)
      >>> pools, views = plan.allocate(), plan.views
      >>> m = views["layers.2.mixer"]
      >>> pools = jaxkv.write_mamba_state(pools, m, jnp.array([1, 2]),
      ...     [jnp.ones((2, 3, 128)), jnp.ones((2, 4, 32, 16))])
      >>> pools = jaxkv.zero_blocks(pools, (m,), jnp.array([1], jnp.int32))
      >>> [float(s.sum()) for s in jaxkv.read_mamba_state(pools, m, jnp.array([1, 2]))]
      [384.0, 2048.0]
    """
    if isinstance(views, KVCacheView | MambaView) or not all(
        isinstance(v, KVCacheView | MambaView) for v in views
    ):
        raise TypeError(
            "zero_blocks: views must be a sequence of layer views, got "
            f"{type(views).__name__}; pass (view,) for one view."
        )
    spaces = {
        (v.num_blocks, v.block_size if isinstance(v, KVCacheView) else 0)
        for v in views
        if isinstance(v, KVCacheView)
    } | {(v.num_blocks, 0) for v in views if isinstance(v, MambaView)}
    if len({n for n, _ in spaces}) > 1 or len({b for _, b in spaces if b}) > 1:
        raise ValueError(
            "zero_blocks: views must share one block space (the same block ids "
            f"and block size), got (num_blocks, block_size) {sorted(spaces)}; zero "
            "kernel views and manager views in separate calls, with ids in each "
            "one's space."
        )
    ids = _device_ids(block_ids, "block_ids")
    out = list(pools)
    for view in views:
        for v in view.states if isinstance(view, MambaView) else (view,):
            _check_dtype_supported(v)
            owned = ids if v.owned is None else jnp.where(v.owns(ids), ids, -1)
            if v.typed:
                rest = [n for d, n in enumerate(v.shape) if d != v.block_dim]
                out[v.pool] = typed.scatter(
                    out[v.pool],
                    v,
                    layer=jnp.int32(v.layer),
                    indexed=(v.block_dim,),
                    indices=(owned,),
                    data=jnp.zeros((ids.shape[0], *rest), v.dtype),
                )
                continue
            plan = _plan(v, (v.block_dim,))
            rest = [v.shape[d] for d in plan.rest_dims]
            zeros = jnp.zeros((ids.shape[0], *rest), v.dtype)
            out[v.pool] = scatter_items(
                out[v.pool], plan, (owned,), (v.num_blocks,), zeros
            )
    return tuple(out)


@jax.jit
def read_view(
    pools: Pools, view: KVCacheView, *, layer: Int[ArrayLike, ""] | None = None
) -> jax.Array:
    """Materialises a whole view in its logical shape (a copy, for inspection).

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4)
      >>> pools, views = plan.allocate(), plan.views
      >>> jaxkv.read_view(pools, views["layers.1.self_attn"]).shape
      (4, 2, 32, 2, 32)
    """
    _check_view(view, KVCacheView, "read_view")  # a MambaView: read_mamba_state
    if view.typed:
        return typed.read_slot(pools[view.pool], view, layer=layer_index(layer, view))
    if layer is not None:
        raise TypeError(
            "read_view: layer= picks a layer slot of a typed pool; this view reads a "
            "flat word pool."
        )
    bd = view.block_dim
    ids = jnp.arange(view.num_blocks, dtype=jnp.int32)
    items = gather_items(
        pools[view.pool],
        _plan(view, (bd,)),
        (ids,),
        (view.num_blocks,),
        view.shape,
        view.dtype,
    )
    return from_bits(jnp.moveaxis(items, 0, bd), view.dtype)
