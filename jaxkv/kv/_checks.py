"""Checks shared by the reads and writes: ids on the host, pools alive, views fit.

Host-side validation names the argument, the layer and the first bad entry;
inside jit an out-of-range id is dropped, never wrapped (``mode="drop"``).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxkv._util import host_int_array
from jaxkv.kv._write_log import record
from jaxkv.plan import KVCacheView, LayerView, MambaView

Pools = tuple[jax.Array, ...]
"""The pool arrays, in the order the plan lists its pools."""

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
    """Ids inside jit as int32; ids past int32 become -1 (dropped).

    Ids inside jit as int32: integers only; ids that cannot be valid (past
    int32) become -1 (dropped), never wrapped.
    """
    ids = jnp.asarray(value)
    if ids.size == 0 and jnp.issubdtype(ids.dtype, jnp.floating):  # [] is float
        return ids.astype(jnp.int32)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{name} must hold integer ids, got dtype {ids.dtype} (float ids would "
            "be truncated and NaN would become 0)."
        )
    if ids.dtype.itemsize > 4 or ids.dtype == jnp.uint32:
        ids = jnp.where((ids < 0) | (ids > _INT32_MAX), -1, ids)
    return ids.astype(jnp.int32)


def _checks_host_ids(
    *names: str, view: type | None = None, resolve: Any = None, records: bool = False
) -> Any:
    """Wraps a jitted op so its view and host-given ids are checked first.

    Wraps a jitted op: its view argument's type (when `view` is given) and its
    host-given id arguments `names` are checked before jit sees them, after
    ``resolve(arguments)`` (when given) rewrote the bound arguments in place.
    `records`: the op is a cache write, logged while recording
    (:func:`jaxkv.kv._write_log.recording_writes`).
    """

    def wrap(fn: Any) -> Any:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            if resolve is not None:
                resolve(bound.arguments)
            if "pools" in bound.arguments:
                check_pools_alive(bound.arguments["pools"], fn.__name__)
            if view is not None:
                _check_view(bound.arguments["view"], view, fn.__name__)
                check_fits(bound.arguments["pools"], bound.arguments["view"])
            if "layer" in sig.parameters:
                check_layer(
                    bound.arguments.get("layer"),
                    bound.arguments["view"],
                    bound.arguments["pools"],
                    fn.__name__,
                )
            for name in names:
                bound.arguments[name] = _host_ids(bound.arguments[name], name)
            out = fn(*bound.args, **bound.kwargs)
            if records:
                arguments = bound.arguments
                record(
                    fn.__name__,
                    arguments["view"],
                    arguments.get("layer"),
                    arguments["pools"],
                    out,
                )
            return out

        call.lower = fn.lower  # pyright: ignore[reportAttributeAccessIssue]
        return call

    return wrap


def _deleted(array: jax.Array) -> bool:
    try:
        return array.is_deleted()
    except jax.errors.ConcretizationTypeError:  # traced: not a buffer
        return False


def any_deleted(tree: Any) -> bool:
    """Whether any array of `tree` was deleted (donated and consumed).

    Whether any array of `tree` was deleted (donated to a call that
    consumed it); traced values never are.
    """
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


def layer_index(layer: object, view: KVCacheView) -> jax.Array:
    """The int32 layer slot a typed pool's access reads: `layer` or the view's own.

    `layer` may be traced (``lax.scan`` over a layer stack). A 64-bit or
    unsigned id past int32 becomes -1 (out of range: the access drops or
    fills) rather than wrapping onto another layer.

    Example:
      >>> import jax.numpy as jnp, jaxkv
      >>> cfg = jaxkv.llama_like_config(num_layers=2)
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4, storage="stacked")
      >>> view = plan.views["layers.1.self_attn"]
      >>> int(jaxkv.kv.layer_index(None, view)), view.layer
      (1, 1)
      >>> int(jaxkv.kv.layer_index(jnp.uint32(2**32 - 1), view))
      -1
    """
    if layer is None:
        if view.stacked:
            raise ValueError(
                "layer=None on the view of a layer stack (KVCachePlan.layer_stack): "
                "it stands for every layer of the stack, so the slot must be named: "
                "pass layer=stack.slots[i] (traced inside the scan), to every "
                "write, read and paged_attention alike; for one layer, use "
                "plan.attention_layer(name) instead."
            )
        return jnp.int32(view.layer)
    ids = jnp.asarray(layer)
    if ids.dtype.itemsize > 4 or ids.dtype == jnp.uint32:
        ids = jnp.where((ids < 0) | (ids > _INT32_MAX), -1, ids)
    return ids.astype(jnp.int32)


def check_fits(pools: Pools, view: LayerView) -> None:
    """Raises unless `view` addresses bytes inside these `pools` (not another plan's).

    Example:
      >>> import jaxkv, pytest
      >>> small = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> big = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> name = "layers.0.self_attn"
      >>> jaxkv.kv.check_fits(big.allocate(), small.views[name])
      >>> with pytest.raises(ValueError, match="another plan"):
      ...     jaxkv.kv.check_fits(small.allocate(), big.views[name])
    """
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
        if np.dtype(pool.dtype).itemsize != v.word:
            raise ValueError(
                f"The view reads pool {v.pool} as {v.word}-byte carrier words "
                f"(uint{8 * v.word}), but that pool is {pool.dtype}"
                f"{list(pool.shape)}: it belongs to another plan or storage (make "
                "views and pools from one plan)."
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


_V = TypeVar("_V")


def _check_view(view: object, kind: type[_V], name: str) -> _V:
    if not isinstance(view, kind):
        raise TypeError(
            f"{name} needs a {kind.__name__}, got {type(view).__name__}; pass the "
            "view bound to an attention layer (or a MambaView for Mamba layers)."
        )
    return view


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
