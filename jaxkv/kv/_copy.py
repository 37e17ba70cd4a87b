"""Block copies inside a plan's pools (vLLM's ``copy_kv_cache_blocks``).

Block copies inside a plan's pools: every layer's bytes of block ``src`` land
in block ``dst`` (vLLM's ``copy_kv_cache_blocks``: copy-on-write of a shared
block, a Mamba state checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Int

from jaxkv._util import checks_own_arguments, host_int_array
from jaxkv.kv import _typed as typed
from jaxkv.kv._checks import (
    Pools,
    _check_dtype_supported,
    check_pools_alive,
)
from jaxkv.kv._ops import _plan
from jaxkv.kv._strided import gather_items, scatter_items
from jaxkv.plan import KVCachePlan, LayerView, MambaView


@checks_own_arguments  # named errors for the ids, before anything changes
def copy_blocks(
    pools: Pools,
    plan: KVCachePlan,
    src: Int[ArrayLike, " n"] | Sequence[int],
    dst: Int[ArrayLike, " n"] | Sequence[int],
) -> Pools:
    """Copies manager block ``src[i]`` to ``dst[i]`` in every layer of every group.

    Copies manager block ``src[i]`` to ``dst[i]`` in every layer of every
    group; returns the pools (donated: their buffers are reused in place).

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
    src_ids, dst_ids = _checked_pairs(plan.num_blocks, src, dst)
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


def _checked_pairs(
    num_blocks: int, src: object, dst: object
) -> tuple[np.ndarray, np.ndarray]:
    ids = {}
    for name, value in (("src", src), ("dst", dst)):
        arr = host_int_array(value, f"copy_blocks: {name}")
        if arr.ndim != 1:
            raise ValueError(
                f"copy_blocks: {name} must be 1-D block ids, got shape {arr.shape}."
            )
        bad = np.flatnonzero((arr < 1) | (arr >= num_blocks))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"copy_blocks: {name}[{i}] = {int(arr[i])} is not a block of the "
                f"pools: expected 1 <= id < num_blocks={num_blocks} (block 0 is "
                "the null block)."
            )
        ids[name] = arr.astype(np.int64)
    src_ids, dst_ids = ids["src"], ids["dst"]
    if src_ids.shape != dst_ids.shape:
        raise ValueError(
            f"copy_blocks: src has {src_ids.size} blocks and dst {dst_ids.size}; "
            "give one destination per source."
        )
    _, first, counts = np.unique(dst_ids, return_index=True, return_counts=True)
    if (counts > 1).any():
        i = int(np.sort(first[counts > 1])[0])
        raise ValueError(
            f"copy_blocks: dst repeats block {int(dst_ids[i])} (dst[{i}] and a later "
            "entry); each destination is written once."
        )
    both = np.flatnonzero(np.isin(dst_ids, src_ids))
    if both.size:
        i = int(both[0])
        raise ValueError(
            f"copy_blocks: dst[{i}] = {int(dst_ids[i])} is also a source; copies "
            "between overlapping blocks would depend on their order (copy in two "
            "calls)."
        )
    return src_ids, dst_ids


@functools.partial(jax.jit, donate_argnums=0)
def _copy(
    pools: Pools,
    views: Sequence[LayerView],
    srcs: Sequence[jax.Array],
    dsts: Sequence[jax.Array],
) -> Pools:
    out = list(pools)
    for view, src, dst in zip(views, srcs, dsts, strict=True):
        for v in view.states if isinstance(view, MambaView) else (view,):
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
