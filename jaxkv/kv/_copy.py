"""Block copies inside a plan's pools (vLLM's ``copy_kv_cache_blocks``).

Block copies inside a plan's pools: every layer's bytes of block ``src`` land
in block ``dst`` (vLLM's ``copy_kv_cache_blocks``: copy-on-write of a shared
block, a Mamba state checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Int

from jaxkv._util import check_positive_int, checks_own_arguments, host_int_array
from jaxkv.groups import AttentionGroup
from jaxkv.kv import _typed as typed
from jaxkv.kv._checks import (
    Pools,
    _check_dtype_supported,
    check_fits,
    check_pools_alive,
)
from jaxkv.kv._ops import _plan
from jaxkv.kv._quant import raw_views
from jaxkv.kv._strided import gather_items, scatter_items
from jaxkv.plan import KVCachePlan, KVCacheView, LayerView, MambaView


@checks_own_arguments  # named errors for the ids, before anything changes
def copy_blocks(
    pools: Pools,
    plan: KVCachePlan,
    src: Int[ArrayLike, " n"] | Sequence[int],
    dst: Int[ArrayLike, " n"] | Sequence[int],
) -> Pools:
    """Copies manager block ``src[i]`` to ``dst[i]`` in every layer of every group.

    Returns the pools (donated: their buffers are reused in place).

    Every layer that owns a view is copied through it, so what moves is
    exactly the bytes those views address for the blocks named, on every
    layout and storage: a group's kernel blocks (a manager block's pieces),
    K and V halves apart (``LHBNC``, KV-first), Mamba states, packed and typed
    pools. Nothing else in a pool changes, and nothing pool-sized is copied
    (the copy gathers ``len(src)`` blocks and scatters them).

    Args:
      pools: The plan's pools.
      plan: The plan.
      src: Blocks to copy from (host integers).
      dst: Blocks to copy to, as many, distinct, none of them in `src`.

    Returns:
      The pools with block ``dst[i]`` holding what block ``src[i]`` holds.

    Raises:
      ValueError: If the ids are not 1-D of one length, a block is the null
        block 0 or past the pool, `dst` repeats a block or shares one with
        `src` (the copies would depend on their order). The message names the
        argument, the entry and its value.
      TypeError: If the ids are not integers or are traced (the checks run
        on the host, before jit).

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> pools = plan.allocate()
      >>> view = plan.views["layers.0.self_attn"]  # blocks of 32 tokens
      >>> k = jnp.ones((16, 2, 32))
      >>> pools = jaxkv.write_kv(pools, view, k, k, jnp.arange(64, 80))  # block 2
      >>> pools = jaxkv.copy_blocks(pools, plan, src=[2], dst=[5])
      >>> keys, _ = jaxkv.gather_kv_pages(pools, view, jnp.array([[2, 5]]))
      >>> float(keys[0, 0].sum()), float(keys[0, 1].sum())
      (1024.0, 1024.0)
    """
    check_pools_alive(pools, "copy_blocks")
    if not isinstance(plan, KVCachePlan):
        raise TypeError(
            f"copy_blocks: plan must be a KVCachePlan, got {type(plan).__name__}."
        )
    src_ids, dst_ids = _checked_pairs("copy_blocks", plan.num_blocks, src, dst)
    if src_ids.size == 0:  # nothing to copy: the pools as they are
        return tuple(pools)
    views: list[LayerView] = []
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    for _, name, group in plan.owning_layers():
        s, d = src_ids, dst_ids
        if group is not None and group.kernel_block_size is not None:
            # A manager block is several kernel blocks of this view.
            s = np.asarray(group.map_to_kernel_block_table(s[:, None])).reshape(-1)
            d = np.asarray(group.map_to_kernel_block_table(d[:, None])).reshape(-1)
        views.append(plan.views[name])
        srcs.append(s.astype(np.int32))
        dsts.append(d.astype(np.int32))
    return _copy(tuple(pools), tuple(views), tuple(srcs), tuple(dsts))


@checks_own_arguments  # named errors for the ids and views, before anything changes
def copy_kv_cache_blocks(
    pools: Pools,
    views: Mapping[str, LayerView],
    *,
    num_blocks: int,
    src: Int[ArrayLike, " n"] | Sequence[int],
    dst: Int[ArrayLike, " n"] | Sequence[int],
) -> Pools:
    """Copies block ``src[i]`` to ``dst[i]`` through each layer's view.

    vLLM's ``copy_kv_cache_blocks_inplace(caches, num_blocks, copies)`` for
    views made without a plan (:func:`jaxkv.vllm.tensor_views`, a
    :class:`~jaxkv.KVCacheView` of your own): the bytes each view addresses
    for block ``src[i]`` land in block ``dst[i]``; a view of ``r *
    num_blocks`` kernel blocks copies the ``r`` kernel blocks of each manager
    block. Layers whose views overlay one another's bytes are copied once
    each, in the order given (equal bytes land). The pools are donated;
    nothing pool-sized is copied. With a plan, :func:`jaxkv.copy_blocks`.

    Args:
      pools: The pools the views address.
      views: Layer name -> its view.
      num_blocks: Manager blocks of the pools (ids range over ``[1,
        num_blocks)``: block 0 is the null block).
      src: Blocks to copy from (host integers).
      dst: Blocks to copy to, as many, distinct, none of them in `src`.

    Returns:
      The pools with block ``dst[i]`` holding what block ``src[i]`` holds.

    Raises:
      ValueError: For ids as :func:`jaxkv.copy_blocks` refuses them, a view
        whose block count is not a multiple of `num_blocks`, or one that
        reads a pool not given or bytes past its pool (the layer named).
      TypeError: If a view is not a layer view or the ids are not integers.

    Example (vLLM 0.33's LBHNC tensor of two layers):
      >>> import jax.numpy as jnp
      >>> import jaxkv, jaxkv.vllm as vllm
      >>> spec = jaxkv.FullAttentionSpec(block_size=2, num_kv_heads=2,
      ...                                head_size=2, dtype="float32")
      >>> t = vllm.LayerTensor(size=2 * 4 * 64, layers=("l0", "l1"),
      ...                      layer_stride=4 * 64, block_stride=64)
      >>> views = vllm.tensor_views(t, spec, num_blocks=4,
      ...                           layout=vllm.TensorLayout.LBHNC)
      >>> pools = (jnp.arange(128, dtype=jnp.uint32),)
      >>> pools = vllm.copy_kv_cache_blocks(pools, views, num_blocks=4,
      ...                                   src=[1], dst=[3])
      >>> pools[0][48:52].tolist(), pools[0][112:116].tolist()  # l0, l1: block 3
      ([16, 17, 18, 19], [80, 81, 82, 83])
    """
    check_pools_alive(pools, "copy_kv_cache_blocks")
    num_blocks = check_positive_int("copy_kv_cache_blocks", "num_blocks", num_blocks)
    src_ids, dst_ids = _checked_pairs("copy_kv_cache_blocks", num_blocks, src, dst)
    chosen: list[LayerView] = []
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    for name, view in views.items():
        if not isinstance(view, LayerView):
            raise TypeError(
                f"copy_kv_cache_blocks: views[{name!r}] must be a layer view "
                f"(KVCacheView or MambaView), got {type(view).__name__}."
            )
        try:
            check_fits(pools, view)
        except ValueError as e:
            raise ValueError(f"copy_kv_cache_blocks: views[{name!r}]: {e}") from None
        leaf = view.states[0] if isinstance(view, MambaView) else view
        n = leaf.num_blocks
        if n % num_blocks:
            raise ValueError(
                f"copy_kv_cache_blocks: views[{name!r}] has {n} blocks, not a "
                f"multiple of num_blocks={num_blocks} (kernel blocks per manager "
                "block must be a whole number)."
            )
        r = n // num_blocks
        pieces = np.arange(r)
        chosen.append(view)
        srcs.append((src_ids[:, None] * r + pieces).reshape(-1).astype(np.int32))
        dsts.append((dst_ids[:, None] * r + pieces).reshape(-1).astype(np.int32))
    return _copy(tuple(pools), tuple(chosen), tuple(srcs), tuple(dsts))


def _checked_pairs(
    op: str, num_blocks: int, src: object, dst: object
) -> tuple[np.ndarray, np.ndarray]:
    ids = {}
    for name, value in (("src", src), ("dst", dst)):
        arr = host_int_array(value, f"{op}: {name}")
        if arr.ndim != 1:
            raise ValueError(
                f"{op}: {name} must be 1-D block ids, got shape {arr.shape}."
            )
        bad = np.flatnonzero((arr < 1) | (arr >= num_blocks))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{op}: {name}[{i}] = {int(arr[i])} is not a block of the "
                f"pools: expected 1 <= id < num_blocks={num_blocks} (block 0 is "
                "the null block)."
            )
        ids[name] = arr.astype(np.int64)
    src_ids, dst_ids = ids["src"], ids["dst"]
    if src_ids.shape != dst_ids.shape:
        raise ValueError(
            f"{op}: src has {src_ids.size} blocks and dst {dst_ids.size}; "
            "give one destination per source."
        )
    _, first, counts = np.unique(dst_ids, return_index=True, return_counts=True)
    if (counts > 1).any():
        i = int(np.sort(first[counts > 1])[0])
        raise ValueError(
            f"{op}: dst repeats block {int(dst_ids[i])} (dst[{i}] and a later "
            "entry); each destination is written once."
        )
    both = np.flatnonzero(np.isin(dst_ids, src_ids))
    if both.size:
        i = int(both[0])
        raise ValueError(
            f"{op}: dst[{i}] = {int(dst_ids[i])} is also a source; copies "
            "between overlapping blocks would depend on their order (copy in two "
            "calls)."
        )
    return src_ids, dst_ids


def block_views(
    plan: KVCachePlan, group: int
) -> list[tuple[LayerView, AttentionGroup]]:
    """The views a block of KV-cache group `group` is moved through.

    Each layer owning its view once, in plan order, with its attention
    group (its kernel blocks); a quantized layer's view as its 8-bit values
    as stored and its scales (:func:`raw_views`). The host tier and
    ``ServingLoop.resize`` move blocks through these.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> [type(v).__name__ for v, _ in jaxkv.kv.block_views(plan, 0)]
      ['KVCacheView', 'KVCacheView']
    """
    seen: set[int] = set()
    out: list[tuple[LayerView, AttentionGroup]] = []
    for attn_group in plan.attn_groups[group]:
        for name in attn_group.layer_names:
            view = plan.views[name]
            if id(view) in seen:
                continue
            seen.add(id(view))
            if isinstance(view, KVCacheView):
                out += [(v, attn_group) for v in raw_views(view)]
            else:
                out.append((view, attn_group))
    return out


def _copied(view: LayerView) -> tuple[KVCacheView, ...]:
    """The views whose bytes a block of `view`'s layer holds.

    A Mamba layer's states; an attention layer's K/V, and the per-token-head
    scales at the end of quantized pages (a block moves with its scales).
    """
    if isinstance(view, MambaView):
        return tuple(view.states)
    return raw_views(view)


@functools.partial(jax.jit, donate_argnums=0)
def _copy(
    pools: Pools,
    views: Sequence[LayerView],
    srcs: Sequence[jax.Array],
    dsts: Sequence[jax.Array],
) -> Pools:
    out = list(pools)
    for view, src, dst in zip(views, srcs, dsts, strict=True):
        for v in _copied(view):
            _check_dtype_supported(v)
            s = src if v.owned is None else jnp.where(v.owns(src), src, -1)
            d = dst if v.owned is None else jnp.where(v.owns(dst), dst, -1)
            if v.typed:
                layer = jnp.int32(v.layer)
                data = typed.gather(
                    out[v.pool], v, layer=layer, indexed=(v.block_dim,), indices=(s,)
                )
                # Scatter the stored values as they are (bits pools: no float
                # conversion of the bits).
                as_stored = dataclasses.replace(v, dtype=data.dtype)
                out[v.pool] = typed.scatter(
                    out[v.pool],
                    as_stored,
                    layer=layer,
                    indexed=(v.block_dim,),
                    indices=(d,),
                    data=data,
                )
                continue
            plan = _plan(v, (v.block_dim,))
            bits = gather_items(
                out[v.pool], plan, (s,), (v.num_blocks,), v.shape, v.dtype
            )
            out[v.pool] = scatter_items(out[v.pool], plan, (d,), (v.num_blocks,), bits)
    return tuple(out)
