"""Reads and writes through layer views: jitted, pool donated, never copying a pool.

Every function takes the tuple of pool arrays and a static view, and returns
the new tuple (writes) or the values read. Writes are windowed scatters of
integer carrier words on the physical pool (a bf16 scatter on XLA:CPU is about
1000x slower than the same bytes as integers); padding and out-of-range ids
write nothing and never wrap around.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Int, Shaped

from jaxkv._util import checks_own_arguments, host_int_array
from jaxkv.cache import _typed as typed
from jaxkv.cache._strided import (
    access_plan,
    from_bits,
    gather_items,
    scatter_items,
    to_bits,
)
from jaxkv.cache._views import KVCacheView, LayerView, MambaView

Pools = tuple[jax.Array, ...]

_INT32_MAX = 2**31 - 1


def _host_ids(value: object, name: str) -> object:
    """Checks ids given as host values (NumPy, lists, ints) before they reach jit.

    Device arrays and tracers pass through (:func:`_device_ids` handles them
    inside jit). On the host, a 64-bit id past int32 would be wrapped by the
    int32 conversion at the jit boundary (with x64 off), so it is an error;
    negative ids are padding and become -1.

    Raises:
      TypeError: If the ids are not integers (floats truncate, NaN becomes 0).
      ValueError: If an id is past the int32 range.
    """
    if isinstance(value, jax.Array):
        return value
    ids = host_int_array(value, name)
    if ids.size and ids.max() > _INT32_MAX:
        shown, value = _first(ids > _INT32_MAX, ids)
        raise ValueError(
            f"{name}: entry {shown} is {value}, past the int32 range of ids "
            "(it would wrap around to another id)."
        )
    return np.where(ids < 0, -1, ids).astype(np.int32)


def _device_ids(value: ArrayLike, name: str) -> jax.Array:
    """Ids inside jit as int32: integers only; ids that cannot be valid (past
    int32) become -1 (dropped), never wrapped.
    """  # noqa: D205
    ids = jnp.asarray(value)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{name} must hold integer ids, got dtype {ids.dtype} (float ids would "
            "be truncated and NaN would become 0)."
        )
    if ids.dtype.itemsize > 4 or ids.dtype == jnp.uint32:
        ids = jnp.where((ids < 0) | (ids > _INT32_MAX), -1, ids)
    return ids.astype(jnp.int32)


def _checks_host_ids(*names: str, view: type | None = None) -> Any:
    """Wraps a jitted op: its view argument's type (when `view` is given) and its
    host-given id arguments `names` are checked before jit sees them.
    """  # noqa: D205

    def wrap(fn: Any) -> Any:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            if "pools" in bound.arguments:
                check_pools_alive(bound.arguments["pools"], fn.__name__)
            if view is not None:
                _check_view(bound.arguments["view"], view, fn.__name__)
                _check_fits(bound.arguments["pools"], bound.arguments["view"])
            if "layer" in sig.parameters:
                check_layer(
                    bound.arguments.get("layer"),
                    bound.arguments["view"],
                    bound.arguments["pools"],
                    fn.__name__,
                )
            for name in names:
                bound.arguments[name] = _host_ids(bound.arguments[name], name)
            return fn(*bound.args, **bound.kwargs)

        call.lower = fn.lower  # pyright: ignore[reportAttributeAccessIssue]
        return call

    return wrap


def _deleted(array: jax.Array) -> bool:
    try:
        return array.is_deleted()
    except jax.errors.ConcretizationTypeError:  # traced: not a buffer
        return False


def any_deleted(tree: Any) -> bool:
    """Whether any array of `tree` was deleted (donated to a call that
    consumed it); traced values never are.
    """  # noqa: D205
    return any(isinstance(x, jax.Array) and _deleted(x) for x in jax.tree.leaves(tree))


def check_pools_alive(pools: Pools, name: str) -> None:
    """Refuses pools donated to an earlier step (JAX deleted them)."""
    for i, pool in enumerate(pools):
        if isinstance(pool, jax.Array) and _deleted(pool):
            raise ValueError(
                f"{name}: pools[{i}] was donated to an earlier step and is deleted; "
                "use the pools that step returned."
            )


def check_layer(layer: object, view: object, pools: Pools, name: str) -> None:
    """A `layer` override is for typed pools only; a host value must be in range."""
    if layer is None:
        return
    if not isinstance(view, KVCacheView) or not view.typed:
        raise TypeError(
            f"{name}: layer= picks a layer slot of a typed (layer-stacked) pool, but "
            "this view reads a flat word pool; plan with storage='stacked' or drop "
            "layer=."
        )
    if isinstance(layer, jax.Array):
        try:
            layer = np.asarray(layer)
        except jax.errors.TracerArrayConversionError:  # traced: checked by type
            if not jnp.issubdtype(layer.dtype, jnp.integer) or layer.shape != ():
                raise TypeError(
                    f"{name}: layer must be an integer scalar, got {layer.dtype}"
                    f"{list(layer.shape)}."
                ) from None
            return
    value = host_int_array(layer, "layer")
    slots = _num_slots(pools[view.pool], view)
    if value.shape != () or not 0 <= int(value) < slots:
        raise ValueError(
            f"{name}: layer={layer!r}, expected an integer scalar in [0, {slots}) "
            f"(the layer slots of pool {view.pool})."
        )


def _num_slots(pool: jax.Array, view: KVCacheView) -> int:
    """Layer slots of a typed pool holding `view`'s layers."""
    return int(np.prod(pool.shape)) // math.prod(view.shape)


def _layer_index(layer: object, view: KVCacheView) -> jax.Array:
    """The slot to access: `layer` (traced or not) or the view's own."""
    if layer is None:
        return jnp.int32(view.layer)
    ids = jnp.asarray(layer)
    if ids.dtype.itemsize > 4 or ids.dtype == jnp.uint32:
        ids = jnp.where((ids < 0) | (ids > _INT32_MAX), -1, ids)
    return ids.astype(jnp.int32)


def _check_fits(pools: Pools, view: LayerView) -> None:
    """The view must address bytes inside these pools (not another plan's)."""
    parts = view.states if isinstance(view, MambaView) else (view,)
    for v in parts:
        if v.pool >= len(pools):
            raise ValueError(
                f"The view reads pool {v.pool}, but {len(pools)} pools were given: "
                "it belongs to another plan (make views and pools from one plan)."
            )
        pool = pools[v.pool]
        if v.typed:
            shape = tuple(pool.shape)
            size = int(np.prod(shape))
            if (
                len(shape) < 2
                or np.dtype(pool.dtype).itemsize != v.itemsize
                or size % math.prod(v.shape)
                or v.layer is None
                or _num_slots(pool, v) <= v.layer
            ):
                raise ValueError(
                    f"The view reads layer slot {v.layer} of a typed pool {v.pool} "
                    f"of {v.nbytes} bytes per slot ({v.dtype.name}), but that pool "
                    f"is {pool.dtype}{list(shape)}: it belongs to another plan (make "
                    "views and pools from one plan)."
                )
            continue
        if pool.ndim > 2:
            raise ValueError(
                f"The view reads pool {v.pool} as words, but that pool is "
                f"{pool.dtype}{list(pool.shape)} (a typed pool): it belongs to another "
                "plan (make views and pools from one plan)."
            )
        nbytes = int(np.prod(pool.shape)) * np.dtype(pool.dtype).itemsize
        if v.extent_bytes > nbytes:
            raise ValueError(
                f"The view reaches byte {v.extent_bytes} of pool {v.pool}, which has "
                f"{nbytes}: it belongs to another plan (make views and pools from one "
                "plan)."
            )


def _check_dtype_supported(view: KVCacheView) -> None:
    """64-bit views need x64: without it JAX stores 32-bit values (wrong bytes)."""
    if (
        view.dtype.itemsize == 8
        and jax.dtypes.canonicalize_dtype(view.dtype) != view.dtype
    ):
        raise TypeError(
            f"The view stores {view.dtype.name}, which needs jax_enable_x64 (without "
            "it JAX computes in 32 bits and the stored bytes would be wrong)."
        )


def _plan(view: KVCacheView, indexed: tuple[int, ...]):
    return access_plan(
        view.offset, view.shape, view.strides, view.itemsize, indexed, view.word
    )


def _check_view(view: object, kind: type, name: str) -> None:
    if not isinstance(view, kind):
        raise TypeError(
            f"{name} needs a {kind.__name__}, got {type(view).__name__}; pass the "
            "view bound to an attention layer (or a MambaView for Mamba layers)."
        )


def _kv_data(view: KVCacheView, key: jax.Array, value: jax.Array | None) -> jax.Array:
    """Per-token data laid out as the view's non-(block, token) dims."""
    key = jnp.asarray(key).astype(view.dtype)
    if "head" not in view.axes:  # MLA: one latent vector per token
        return key
    if value is None:
        raise ValueError(f"A {view.axes} view stores K and V; value is missing.")
    value = jnp.asarray(value).astype(view.dtype)
    # Concatenate as integers: moving bf16/fp8 through float could flush bits.
    both = jnp.concatenate([to_bits(key), to_bits(value)], axis=-1)  # fused K|V
    return from_bits(both, view.dtype)


def _check_kv_shapes(
    view: KVCacheView, key: jax.Array, value: jax.Array | None
) -> None:
    rest = [
        view.shape[d]
        for d, a in enumerate(view.axes)
        if a not in ("block", "token", "kv")
    ]
    if "head" in view.axes and "kv" not in view.axes:  # fused: (H, D) and (H, Dv)
        expected_k = (rest[0], view.head_size)
        expected_v = (rest[0], rest[1] - view.head_size)
    else:
        expected_k = expected_v = tuple(rest)
    if key.ndim != len(expected_k) + 1 or tuple(key.shape[1:]) != expected_k:
        raise ValueError(
            f"key.shape={tuple(key.shape)}, expected (num_tokens, *{expected_k}) for a "
            f"view of shape {view.shape}."
        )
    if value is not None and (tuple(value.shape) != (key.shape[0], *expected_v)):
        raise ValueError(
            f"value.shape={tuple(value.shape)}, expected {(key.shape[0], *expected_v)}."
        )


@_checks_host_ids("slot_mapping", view=KVCacheView)
@functools.partial(jax.jit, donate_argnums=0)
@checks_own_arguments
def write_kv(
    pools: Pools,
    view: KVCacheView,
    key: Shaped[ArrayLike, "num_tokens ..."],
    value: Shaped[ArrayLike, "num_tokens ..."] | None,
    slot_mapping: Int[ArrayLike, " num_tokens"],
    *,
    layer: Int[ArrayLike, ""] | None = None,
) -> Pools:
    """Writes new K/V of a batch of tokens through `view`; the pools are donated.

    Slot ``x`` writes token ``x % k`` of block ``x // k`` (``k`` = the view's
    block size; kernel slots for kernel views). Negative slots (padding),
    slots past the view's blocks and slots of blocks the view does not own
    (another layer's page of a packed pool) write nothing; 64-bit slots past
    int32 are rejected on the host and dropped inside jit, never wrapped.

    Args:
      pools: The pool arrays (donated).
      view: The layer's view (static).
      key: ``(num_tokens, num_kv_heads, head_dim)`` keys, or ``(num_tokens,
        head_dim)`` latents for MLA.
      value: ``(num_tokens, num_kv_heads, head_dim_v)`` values, or ``None`` for
        MLA.
      slot_mapping: ``(num_tokens,)`` int32 slots, unique apart from padding
        (which of two writes to one slot wins is unspecified).
      layer: For a view of a layer-stacked typed pool: the layer slot to write,
        possibly traced (``lax.scan`` over layers); ``None``: the view's own.
        A traced slot outside the pool writes nothing.

    Returns:
      The new pools.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
      >>> view = views["layers.0.self_attn"]
      >>> k = jnp.ones((3, 2, 32), jnp.float32)
      >>> pools = jaxkv.write_kv(pools, view, k, 2 * k,
      ...                        jnp.array([33, -1, 40], jnp.int32))
      >>> kp, vp = jaxkv.gather_kv_pages(pools, view, jnp.array([[1]], jnp.int32))
      >>> float(kp[0, 0, 1].sum()), float(vp[0, 0, 8, 0, 0]), float(kp[0, 0, 0].sum())
      (64.0, 2.0, 0.0)
    """
    _check_view(view, KVCacheView, "write_kv")
    _check_dtype_supported(view)
    key = jnp.asarray(key)
    value = None if value is None else jnp.asarray(value)
    for name, x in (("key", key), ("value", value)):
        if x is not None and not (
            jnp.issubdtype(x.dtype, jnp.floating)
            or jnp.issubdtype(x.dtype, jnp.integer)
        ):
            raise TypeError(
                f"write_kv: {name} has dtype {x.dtype}; the view stores "
                f"{view.dtype.name} (real numbers only)."
            )
    _check_kv_shapes(view, key, value)
    if "head" in view.axes and value is None:
        raise ValueError(
            f"A view with axes {view.axes} stores K and V; value is missing."
        )
    slots = _device_ids(slot_mapping, "slot_mapping")
    if slots.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping.shape={slots.shape}, expected (num_tokens,)="
            f"({key.shape[0]},)."
        )
    if slots.shape[0] == 0:
        return pools
    k = view.block_size
    if view.owned is not None:
        slots = jnp.where(view.owns(slots // k), slots, -1)
    bd, td = view.block_dim, view.dim("token")
    block, token = slots // k, slots % k
    pool = pools[view.pool]
    if view.typed:
        return _replace(
            pools, view.pool, _write_typed(pool, view, key, value, block, token, layer)
        )
    if "kv" in view.axes:
        # K and V rows go out in one scatter: the token-axis concatenation fuses
        # into the carrier bitcast, so the program has one data kernel, one index
        # kernel and one scatter (each extra kernel costs a thread hand-off on CPU).
        if value is None:  # unreachable: checked above; narrows the type
            raise ValueError("value is missing.")
        plan = _plan(view, (bd, td, view.dim("kv")))
        limits = (view.shape[bd], k, 2)
        n = slots.shape[0]
        halves = jnp.concatenate(
            [jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.int32)]
        )
        data = jnp.concatenate(
            [to_bits(key.astype(view.dtype)), to_bits(value.astype(view.dtype))]
        )
        pool = scatter_items(
            pool,
            plan,
            (jnp.tile(block, 2), jnp.tile(token, 2), halves),
            limits,
            from_bits(data, view.dtype),
        )
        return _replace(pools, view.pool, pool)
    plan = _plan(view, (bd, td))
    new = scatter_items(
        pool, plan, (block, token), (view.shape[bd], k), _kv_data(view, key, value)
    )
    return _replace(pools, view.pool, new)


def _write_typed(
    pool: jax.Array,
    view: KVCacheView,
    key: jax.Array,
    value: jax.Array | None,
    block: jax.Array,
    token: jax.Array,
    layer: object,
) -> jax.Array:
    """`write_kv` on a typed pool: one scatter indexed by (layer, block, token)."""
    bd, td = view.block_dim, view.dim("token")
    slot = _layer_index(layer, view)
    if "kv" in view.axes:
        if value is None:  # unreachable: checked by write_kv
            raise ValueError("value is missing.")
        n = block.shape[0]
        halves = jnp.concatenate(
            [jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.int32)]
        )
        data = jnp.concatenate(
            [to_bits(key.astype(view.dtype)), to_bits(value.astype(view.dtype))]
        )
        return typed.scatter(
            pool,
            view,
            layer=slot,
            indexed=(bd, td, view.dim("kv")),
            indices=(jnp.tile(block, 2), jnp.tile(token, 2), halves),
            data=from_bits(data, view.dtype),
        )
    return typed.scatter(
        pool,
        view,
        layer=slot,
        indexed=(bd, td),
        indices=(block, token),
        data=_kv_data(view, key, value),
    )


def _replace(pools: Pools, index: int, new: jax.Array) -> Pools:
    return tuple(new if i == index else p for i, p in enumerate(pools))


@_checks_host_ids("block_table", view=KVCacheView)
@jax.jit
@checks_own_arguments
def gather_kv_pages(
    pools: Pools,
    view: KVCacheView,
    block_table: Int[ArrayLike, "rows cols"],
    *,
    layer: Int[ArrayLike, ""] | None = None,
) -> tuple[
    Shaped[Array, "rows cols page_size ..."],
    Shaped[Array, "rows cols page_size ..."] | None,
]:
    """Reads the K/V pages of a block table through `view` (the attention read path).

    Args:
      pools: The pool arrays.
      view: The layer's view (static).
      block_table: ``(rows, cols)`` int32 block ids in the view's block space.
        Ids outside ``[0, num_blocks)`` or not owned by the view read as
        all-ones bits (NaN for floats).
      layer: For a layer-stacked typed pool: the layer slot (possibly traced);
        ``None``: the view's own.

    Returns:
      ``(k_pages, v_pages)``, each ``(rows, cols, page_size, num_kv_heads,
      head_dim)``; for MLA ``(latents (rows, cols, page_size, head_dim), None)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
      >>> k, v = jaxkv.gather_kv_pages(pools, views["layers.0.self_attn"],
      ...                              jnp.array([[1, 2], [3, 0]], jnp.int32))
      >>> k.shape, v.shape
      ((2, 2, 32, 2, 32), (2, 2, 32, 2, 32))
    """
    _check_view(view, KVCacheView, "gather_kv_pages")
    _check_dtype_supported(view)
    table = _device_ids(block_table, "block_table")
    if view.owned is not None:
        table = jnp.where(view.owns(table), table, -1)
    if table.ndim != 2:
        raise ValueError(f"block_table.shape={table.shape}, expected (rows, cols).")
    bd = view.block_dim
    ids = table.reshape(-1)
    if view.typed:
        return _gather_typed(pools[view.pool], view, ids, table.shape, layer)
    if "kv" in view.axes:
        # Gather K and V separately so no (.., 2, ..) intermediate is built.
        kvd = view.dim("kv")
        plan = _plan(view, (bd, kvd))
        out = []
        for half in (0, 1):
            pages = gather_items(
                pools[view.pool],
                plan,
                (ids, jnp.full_like(ids, half)),
                (view.shape[bd], 2),
                view.shape,
                view.dtype,
            )
            pages = pages.reshape(*table.shape, *pages.shape[1:])
            out.append(from_bits(pages, view.dtype))
        return out[0], out[1]
    plan = _plan(view, (bd,))
    pages = gather_items(
        pools[view.pool], plan, (ids,), (view.shape[bd],), view.shape, view.dtype
    )
    pages = pages.reshape(*table.shape, *pages.shape[1:])
    if "head" not in view.axes:
        return from_bits(pages, view.dtype), None
    return (
        from_bits(pages[..., : view.head_size], view.dtype),
        from_bits(pages[..., view.head_size :], view.dtype),
    )


def _gather_typed(
    pool: jax.Array,
    view: KVCacheView,
    ids: jax.Array,
    rows_cols: tuple[int, ...],
    layer: object,
) -> tuple[jax.Array, jax.Array | None]:
    """`gather_kv_pages` on a typed pool: gathers indexed by (layer, block)."""
    bd = view.block_dim
    slot = _layer_index(layer, view)

    def pages_of(x: jax.Array) -> jax.Array:
        return x.reshape(*rows_cols, *x.shape[1:])

    if "kv" in view.axes:
        kvd = view.dim("kv")
        k, v = (
            pages_of(
                typed.gather(
                    pool,
                    view,
                    layer=slot,
                    indexed=(bd, kvd),
                    indices=(ids, jnp.full_like(ids, half)),
                )
            )
            for half in (0, 1)
        )
        return from_bits(k, view.dtype), from_bits(v, view.dtype)
    pages = pages_of(
        typed.gather(pool, view, layer=slot, indexed=(bd,), indices=(ids,))
    )
    if "head" not in view.axes:
        return from_bits(pages, view.dtype), None
    return (
        from_bits(pages[..., : view.head_size], view.dtype),
        from_bits(pages[..., view.head_size :], view.dtype),
    )


@_checks_host_ids("block_ids", view=MambaView)
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
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
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
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
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
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
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
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
      >>> jaxkv.read_view(pools, views["layers.1.self_attn"]).shape
      (4, 2, 32, 2, 32)
    """
    if view.typed:
        return typed.read_slot(pools[view.pool], view, layer=_layer_index(layer, view))
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
    _check_fits(pools, view)
    check_layer(layer, view, pools, "kernel_cache")
    pool = pools[view.pool]
    phys = typed.slot_shape(view)
    if _num_slots(pool, view) == 1 and layer is None:
        if shape is not None and tuple(shape) == tuple(pool.shape):
            return pool  # the pool is the kernel's array
        slot = pool.reshape(phys)
    else:
        slots = pool.reshape((-1, *phys))
        slot = lax.dynamic_index_in_dim(
            slots, _layer_index(layer, view), 0, keepdims=False
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
    _check_fits(pools, view)
    check_layer(layer, view, pools, "put_kernel_cache")
    pool = pools[view.pool]
    phys = typed.slot_shape(view)
    cache = jnp.asarray(cache)
    if int(np.prod(cache.shape)) != int(np.prod(phys)) or cache.dtype != pool.dtype:
        raise ValueError(
            f"put_kernel_cache: cache is {cache.dtype}{list(cache.shape)}, expected "
            f"{int(np.prod(phys))} elements of {pool.dtype} (the layer's cache "
            f"{phys})."
        )
    if _num_slots(pool, view) == 1 and layer is None:
        return _replace(pools, view.pool, cache.reshape(pool.shape))
    slots = pool.reshape((-1, *phys))
    new = lax.dynamic_update_index_in_dim(
        slots, cache.reshape(phys), _layer_index(layer, view), 0
    )
    return _replace(pools, view.pool, new.reshape(pool.shape))


def validate_slot_mapping(
    slot_mapping: ArrayLike, view: KVCacheView, layer_name: str = "<layer>"
) -> None:
    """Host-side check: every slot is ``-1`` (padding) or inside the view.

    Raises:
      ValueError: Naming the layer and the first bad index.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> view = jaxkv.KVCacheView(pool=0, offset=0, shape=(4, 2, 16, 1, 8),
      ...     strides=(256, 128, 8, 8, 1), dtype="float32",
      ...     axes=("block", "kv", "token", "head", "dim"))
      >>> jaxkv.validate_slot_mapping(np.array([0, 63, -1]), view, "l0")
      >>> jaxkv.validate_slot_mapping(np.array([0, 64]), view, "l0")
      Traceback (most recent call last):
      ...
      ValueError: slot_mapping for layer 'l0': entry 1 is 64, outside [0, 64) and not the padding value -1.
    """  # noqa: E501
    slots = _host_array(slot_mapping, "slot_mapping", layer_name)
    limit = view.num_blocks * view.block_size
    bad = np.flatnonzero((slots != -1) & ((slots < 0) | (slots >= limit)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"slot_mapping for layer {layer_name!r}: entry {i} is {int(slots[i])}, "
            f"outside [0, {limit}) and not the padding value -1."
        )
    foreign = np.flatnonzero((slots >= 0) & ~view.owns(slots // view.block_size))
    if foreign.size and view.owned is not None:
        i, (stride, pieces) = int(foreign[0]), view.owned
        raise ValueError(
            f"slot_mapping for layer {layer_name!r}: entry {i} is {int(slots[i])}, in "
            f"block {int(slots[i]) // view.block_size}, which is another layer's page "
            f"of this packed pool (the layer owns blocks b with b % {stride} < "
            f"{pieces})."
        )


def validate_block_ids(
    block_ids: ArrayLike, view: LayerView, layer_name: str = "<layer>"
) -> None:
    """Host-side check: every block id is inside ``[0, num_blocks)``.

    Raises:
      ValueError: Naming the layer and the first bad index.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> view = jaxkv.KVCacheView(pool=0, offset=0, shape=(4, 2, 16, 1, 8),
      ...     strides=(256, 128, 8, 8, 1), dtype="float32",
      ...     axes=("block", "kv", "token", "head", "dim"))
      >>> jaxkv.validate_block_ids(np.array([[0, 5]]), view, "l0")
      Traceback (most recent call last):
      ...
      ValueError: block ids for layer 'l0': entry (0, 1) is 5, outside [0, 4).
    """
    ids = _host_array(block_ids, "block_ids", layer_name)
    for mask, why in (
        ((ids < 0) | (ids >= view.num_blocks), f"outside [0, {view.num_blocks})"),
        (
            ~view.owns(ids) if isinstance(view, KVCacheView) else ids < 0,
            "another layer's page of this packed pool",
        ),
    ):
        if mask.any():
            shown, value = _first(mask, ids)
            raise ValueError(
                f"block ids for layer {layer_name!r}: entry {shown} is {value}, {why}."
            )


def _first(mask: np.ndarray, values: np.ndarray) -> tuple[object, int]:
    """The first index where `mask` holds (an int for 1-D) and the value there."""
    where = tuple(int(i) for i in np.argwhere(mask)[0])
    return (where[0] if len(where) == 1 else where), int(values[where])


def _host_array(value: ArrayLike, name: str, layer_name: str) -> np.ndarray:
    """A host validator's integer NumPy array (not a traced value, not floats)."""
    return host_int_array(value, f"{name} for layer {layer_name!r}")
