"""Reads and writes through layer views: jitted, pool donated, never copying a pool.

Every function takes the tuple of pool arrays and a static view, and returns
the new tuple (writes) or the values read. Writes are windowed scatters of
integer carrier words on the physical pool (a bf16 scatter on XLA:CPU is about
1000x slower than the same bytes as integers); padding and out-of-range ids
write nothing and never wrap around.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, Shaped

from jaxkv._util import checks_own_arguments
from jaxkv.kv import _typed as typed
from jaxkv.kv._checks import (
    Pools,
    _check_dtype_supported,
    _check_view,
    _checks_host_ids,
    _device_ids,
    layer_index,
)
from jaxkv.kv._kernel_table import GPU_PLATFORMS, Kernel, KernelTable
from jaxkv.kv._native_write import native_write, native_write_unfit
from jaxkv.kv._page_layout import pallas_view_unfit
from jaxkv.kv._pallas_write import gpu_write, tpu_write, tpu_write_unfit
from jaxkv.kv._quant import quant_unfit, quantize, raw_views
from jaxkv.kv._strided import (
    access_plan,
    from_bits,
    gather_items,
    scatter_items,
    to_bits,
)
from jaxkv.plan import AttentionLayer, GroupSlots, KVCacheView


def _plan(view: KVCacheView, indexed: tuple[int, ...]):
    return access_plan(
        view.offset, view.shape, view.strides, view.itemsize, indexed, view.word
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


def _layer_slots(view: object, slot_mapping: object) -> tuple[Any, Any]:
    """A layer's view and slot mapping from an :class:`AttentionLayer`.

    Another group's metadata is refused; a bare view and slot array come
    back as given.
    """
    if isinstance(view, AttentionLayer):
        group = getattr(slot_mapping, "group", None)
        if None not in (view.group, group) and view.group != group:
            raise ValueError(
                f"write_kv: layer {view.name!r} writes KV-cache group {view.group}'s "
                f"slots, but the metadata is group {group}'s (another group's slots "
                f"address other pages); pass builder.metadata(inputs)[{view.name!r}]."
            )
        view = view.view
    elif isinstance(view, KVCacheView) and view.groups:
        group = getattr(slot_mapping, "group", None)
        if group is not None and group not in view.groups:
            raise ValueError(
                f"write_kv: the view (pool {view.pool}, offset {view.offset}) is "
                f"bound to KV-cache group(s) {list(view.groups)}, but the metadata "
                f"is group {group}'s (another group's slots address other pages); "
                "pass the layer (plan.attention_layer(name)) and "
                "builder.metadata(inputs)[name]."
            )
    if isinstance(slot_mapping, GroupSlots):
        slot_mapping = slot_mapping.slot_mapping
    return view, slot_mapping


def _resolve_layer_slots(arguments: dict[str, Any]) -> None:
    arguments["view"], arguments["slot_mapping"] = _layer_slots(
        arguments["view"], arguments["slot_mapping"]
    )


#: Static scales given as a tuple of floats, one per KV head (or None).
Scales = tuple[float, ...] | None


@_checks_host_ids(
    "slot_mapping", view=KVCacheView, resolve=_resolve_layer_slots, records=True
)
@functools.partial(jax.jit, donate_argnums=0, static_argnames="implementation")
@checks_own_arguments
def write_kv(
    pools: Pools,
    view: AttentionLayer | KVCacheView,
    key: Shaped[ArrayLike, "num_tokens ..."],
    value: Shaped[ArrayLike, "num_tokens ..."] | None,
    slot_mapping: GroupSlots | Int[ArrayLike, " num_tokens"],
    *,
    layer: Int[ArrayLike, ""] | None = None,
    implementation: str | None = None,
    k_scale: Float[ArrayLike, ""] | Float[ArrayLike, " kv_heads"] | Scales = None,
    v_scale: Float[ArrayLike, ""] | Float[ArrayLike, " kv_heads"] | Scales = None,
) -> Pools:
    """Writes new K/V of a batch of tokens through `view`; the pools are donated.

    Slot ``x`` writes token ``x % k`` of block ``x // k`` (``k`` = the view's
    block size; kernel slots for kernel views). Negative slots (padding),
    slots past the view's blocks and slots of blocks the view does not own
    (another layer's page of a packed pool) write nothing; 64-bit slots past
    int32 are rejected on the host and dropped inside jit, never wrapped.

    The form every page teaches is ``write_kv(pools, layer, k, v, meta)``:
    the layer's :class:`AttentionLayer` (``plan.attention_layer(name)``) and
    its step metadata, checked to be of one KV-cache group. vLLM's form, a
    bound view and a bare slot array (``reshape_and_cache``), is taken too;
    a bare array carries no group and is not checked.

    Args:
      pools: The pool arrays (donated).
      view: The layer's :class:`AttentionLayer`, or its view (static).
      key: ``(num_tokens, num_kv_heads, head_dim)`` keys, or ``(num_tokens,
        head_dim)`` latents for MLA.
      value: ``(num_tokens, num_kv_heads, head_dim_v)`` values, or ``None`` for
        MLA.
      slot_mapping: ``(num_tokens,)`` int32 slots, unique apart from padding
        (which of two writes to one slot wins is unspecified); or the layer's
        step metadata (its ``slot_mapping`` is used), whose KV-cache group
        must then be the layer's when `view` is an :class:`AttentionLayer`
        (another group's slots address other pages).
      layer: For a view of a layer-stacked typed pool: the layer slot to write,
        possibly traced (``lax.scan`` over layers); ``None``: the view's own.
        A traced slot outside the pool writes nothing.
      implementation: Which kernel writes (as ``paged_attention``'s):
        ``None``: jaxkv's Pallas write on GPU and TPU where the view fits
        (:func:`pallas_view_unfit`), else XLA's scatter (and on CPU);
        ``"xla"``: XLA's scatter, every platform and view;
        ``"pallas"``: the platform's Pallas write (Triton on GPU, Mosaic
        on TPU; on CPU the GPU kernel in interpret mode);
        ``"pallas_gpu"`` / ``"pallas_tpu"``: that kernel, compiled on its
        platform and interpreted elsewhere; ``"native"``: jaxkv's C++
        XLA:CPU write (opt-in; compiled on first use). Every one writes the
        same bytes; one asked for by name that cannot take the view raises,
        naming why. Quantized pages (the spec's ``kv_quant_mode``) are
        quantized by XLA (elementwise, the step's tokens only:
        :mod:`jaxkv.kv._quant`); the 8-bit values and their scales are then
        written as stored by XLA's scatter or, asked for by ``"native"``,
        the native kernel.
      k_scale: The static K scale of ``"fp8_per_tensor"`` pages (vLLM's
        ``layer._k_scale``; default 1.0), a scalar or one per KV head
        (``(kv_heads,)``, vLLM's per-attention-head scales; on a mesh, this
        rank's heads'): ``k / k_scale`` is stored. Only
        for those pages (per-token-head pages compute their own).
      v_scale: The same for V.

    Returns:
      The new pools.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4)
      >>> pools, views = plan.allocate(), plan.views
      >>> view = views["layers.0.self_attn"]
      >>> k = jnp.ones((3, 2, 32), jnp.float32)
      >>> pools = jaxkv.write_kv(pools, view, k, 2 * k,
      ...                        jnp.array([33, -1, 40], jnp.int32))
      >>> kp, vp = jaxkv.gather_kv_pages(pools, view, jnp.array([[1]], jnp.int32))
      >>> float(kp[0, 0, 1].sum()), float(vp[0, 0, 8, 0, 0]), float(kp[0, 0, 0].sum())
      (64.0, 2.0, 0.0)
    """
    # An AttentionLayer and its metadata were resolved to the view and slot
    # mapping by the wrapper (_resolve_layer_slots), before jit.
    view = _check_view(view, KVCacheView, "write_kv")
    slot_mapping = cast("ArrayLike", slot_mapping)  # its record resolved too
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
    if view.kv_quant_mode != "fp8_per_tensor" and (
        k_scale is not None or v_scale is not None
    ):
        raise ValueError(
            "write_kv: k_scale / v_scale are the static scales of fp8_per_tensor "
            f"pages; this view holds {view.kv_quant_mode!r} pages."
        )
    if slots.shape[0] == 0:
        return pools
    if view.kv_quant_mode != "none":
        if implementation not in (None, "xla", "native"):
            raise ValueError(
                f"write_kv: implementation={implementation!r} cannot write this "
                f"view: {quant_unfit(view)} (None picks it)."
            )
        # Quantized by XLA (elementwise, the step's tokens only); the 8-bit
        # values and their scales are then moved as stored, by the kernel
        # the plain views pick (the native kernel on a CPU, in place).
        _check_quant_input(view, key, value, k_scale, v_scale)
        key, key_scales = quantize(key, view, k_scale)
        if value is not None:
            value, value_scales = quantize(value, view, v_scale)
        else:
            value_scales = None
        plain, *scales = raw_views(view)
        pools = _write(pools, plain, key, value, slots, layer, implementation)
        if key_scales is None or not scales:
            return pools
        both = (key_scales, key_scales if value_scales is None else value_scales)
        k_s, v_s = (x[..., None] for x in both)
        return _write(pools, scales[0], k_s, v_s, slots, None, implementation)
    return _write(pools, view, key, value, slots, layer, implementation)


def _write(
    pools: Pools,
    view: KVCacheView,
    key: jax.Array,
    value: jax.Array | None,
    slots: jax.Array,
    layer: object,
    implementation: str | None,
) -> Pools:
    """The write of checked K/V in `view`'s dtype, on the kernel picked."""
    picks = WRITE_KERNELS.pick(implementation, view, value)
    names = set(picks.values())
    fallback = WRITE_KERNELS.fallback.name
    if names == {fallback}:
        return _xla_write(pools, view, key, value, slots, layer)
    args = (pools[view.pool], key, value, slots, layer)
    kernel = WRITE_KERNELS[next(iter(names))]
    if len(names) == 1 and not kernel.interpretable:  # the same call everywhere
        new = _write_branch(kernel.name, "cpu", view)(*args)
    else:
        # Each platform's branch is lowered only when compiling for it: a
        # device never holds an interpreter, and CPU interprets.
        new = jax.lax.platform_dependent(
            *args,
            **{p: _write_branch(name, p, view) for p, name in picks.items()},
        )
    return _replace(pools, view.pool, new)


def _check_quant_input(
    view: KVCacheView, key: jax.Array, value: jax.Array | None, *scales: object
) -> None:
    """Quantized pages take real values; already-8-bit ones only as raw fp8 copies.

    K/V already in the pages' dtype (gathered from another cache: a
    transfer) would be quantized again, and their per-token-head scales are
    not in them: refused. fp8_per_tensor pages
    take them as they are when no scale is given (their bytes, copied).
    """
    raw = key.dtype == view.dtype or (value is not None and value.dtype == view.dtype)
    if not raw:
        return
    if view.kv_quant_mode == "fp8_per_tensor" and all(s is None for s in scales):
        return
    raise ValueError(
        f"write_kv: key/value are already {view.dtype.name} ({view.kv_quant_mode} "
        "pages quantize real-valued K/V as they are written): quantized values "
        "carry no scales. Move quantized blocks through jaxkv.kv.raw_views "
        "(copy_blocks, the host tier and ServingLoop.resize do); transfers "
        "between plans do not yet."
    )


def _write_branch(name: str, platform: str, view: KVCacheView) -> Any:
    """Kernel `name` writing through `view` on `platform`: ``(pool, ...) -> pool``."""
    kernel = WRITE_KERNELS[name]
    interpret = kernel.interpretable and not kernel.runs_on(platform)

    def go(pool, key, value, slots, layer):
        return kernel.run(
            pool, view, key, value, slots, layer, interpret=interpret, platform=platform
        )

    return go


def _xla_kernel(pool, view, key, value, slots, layer, *, interpret, platform):
    del interpret, platform
    own = dataclasses.replace(view, pool=0)
    return _xla_write((pool,), own, key, value, slots, layer)[0]


def _pallas_unfit(view: KVCacheView, value: jax.Array | None) -> str | None:
    reason = pallas_view_unfit(view)
    if reason is None and value is None:
        reason = "no value (MLA latents)"
    return reason


WRITE_KERNELS = KernelTable("write_kv", Kernel("xla", run=_xla_kernel))
"""``write_kv``'s kernels (a :class:`KernelTable`; ``unfit`` takes ``(view, value)``).

``xla`` (XLA's scatter) everywhere; ``pallas_gpu`` on cuda and rocm and
``pallas_tpu`` on tpu, picked by ``None`` where they take the view (the
``"pallas"`` family; interpreted elsewhere); ``native`` (C++, XLA:CPU)
opt-in."""
WRITE_KERNELS.register(
    Kernel(
        "pallas_gpu",
        run=lambda *a, interpret, platform: gpu_write(*a, interpret=interpret),
        platforms=GPU_PLATFORMS,
        unfit=_pallas_unfit,
        family="pallas",
        default=True,
        interpretable=True,
    )
)
WRITE_KERNELS.register(
    Kernel(
        "pallas_tpu",
        run=lambda *a, interpret, platform: tpu_write(*a, interpret=interpret),
        platforms=("tpu",),
        unfit=lambda view, value: _pallas_unfit(view, value) or tpu_write_unfit(view),
        family="pallas",
        default=True,
        interpretable=True,
    )
)
WRITE_KERNELS.register(
    Kernel(
        "native",
        run=lambda *a, interpret, platform: native_write(*a),
        platforms=("cpu",),
        unfit=native_write_unfit,
    )
)
WRITE_IMPLEMENTATIONS = WRITE_KERNELS.implementations
"""What ``write_kv(implementation=)`` takes (with jaxkv's own kernels)."""


def _xla_write(
    pools: Pools,
    view: KVCacheView,
    key: jax.Array,
    value: jax.Array | None,
    slots: jax.Array,
    layer: object,
) -> Pools:
    """`write_kv` as XLA scatters (every platform and view)."""
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
    slot = layer_index(layer, view)
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
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4)
      >>> pools, views = plan.allocate(), plan.views
      >>> k, v = jaxkv.gather_kv_pages(pools, views["layers.0.self_attn"],
      ...                              jnp.array([[1, 2], [3, 0]], jnp.int32))
      >>> k.shape, v.shape
      ((2, 2, 32, 2, 32), (2, 2, 32, 2, 32))
    """
    _check_view(view, KVCacheView, "gather_kv_pages")
    view = view.logical()
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
    slot = layer_index(layer, view)

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
