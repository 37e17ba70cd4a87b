"""Pools made: zero-initialised arrays under jit, and vLLM's allocators.

Pools made: zero-initialised arrays under jit (one program per pool shape), and
vLLM's ``init_kv_cache`` and ``planned_pools`` over them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import KVCacheConfig, RunnerConfig
from jaxkv.groups import AttentionGroup, check_kernel_block_sizes
from jaxkv.plan._kernel_views import kernel_views
from jaxkv.plan._layer_views import build_kv_cache_views
from jaxkv.plan._pools import PlannedPools, PoolSpec, plan_pools
from jaxkv.plan._views import LayerView


def allocate_pools(
    pools: Sequence[PoolSpec], sharding: jax.sharding.Sharding | None = None
) -> tuple[jax.Array, ...]:
    """Zero-initialised pools, created under jit (no host-sized array).

    Example:
      >>> import jaxkv
      >>> from jaxkv.plan import PoolSpec, allocate_pools
      >>> (pool,) = allocate_pools([PoolSpec(size_bytes=64, word=4)])
      >>> pool.shape, pool.dtype
      ((16,), dtype('uint32'))
    """
    return tuple(zeros(p.shape, np.dtype(p.dtype), sharding) for p in pools)


@functools.cache
def _zeros_fn(sharding: Any) -> Any:
    """One jitted zeros per output sharding (compiled once per pool shape)."""
    return jax.jit(
        lambda shape, dtype: jnp.zeros(shape, dtype),
        static_argnums=(0, 1),
        out_shardings=sharding,
    )


def zeros(shape: tuple[int, ...], dtype: np.dtype, sharding: Any) -> jax.Array:
    """A zeroed array made under jit on `sharding` (one compile per shape)."""
    return _zeros_fn(sharding)(tuple(shape), dtype)


class KVCacheInit(NamedTuple):
    """What :func:`init_kv_cache` returns; unpacks as ``pools, kv_caches``.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> init = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
      >>> len(init.pools), init.kv_caches["layers.0.self_attn"].pool
      (2, 0)
    """

    pools: tuple[jax.Array, ...]
    """One zeroed array per pool."""
    kv_caches: dict[str, LayerView]
    """``layer -> view`` of those pools."""


def init_kv_cache(
    kv_cache_config: KVCacheConfig,
    vllm_config: RunnerConfig,
    kernel_block_sizes: Sequence[int],
    attn_groups: Sequence[Sequence[AttentionGroup]],
    *,
    sharding: jax.sharding.Sharding | None = None,
    storage: str = "words",
    pool_dtype: str = "auto",
) -> KVCacheInit:
    """Allocates one zeroed array per pool and builds every layer's view of it.

    One array per unpacked KVCacheTensor plus one for all packed tensors: the
    single source of truth for every layer viewing it, whatever their dtypes.

    Args:
      kv_cache_config: Pools and groups.
      vllm_config: The runner configuration.
      kernel_block_sizes: From :func:`init_attn_backend`.
      attn_groups: From :func:`init_attn_backend`.
      sharding: Optional sharding of every pool.
      storage: ``"words"`` (the seeds' flat carrier-word pools, the default
        here), ``"typed"``, ``"stacked"`` or ``"auto"`` (see :func:`plan_pools`
        and :func:`resolve_storage`).
      pool_dtype: For typed pools: ``"element"``, ``"bits"`` or ``"auto"``.

    Returns:
      ``(pools, kv_caches)`` (a :class:`KVCacheInit`): the pool arrays and
      ``layer -> view``.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
      >>> [p.nbytes for p in pools], views["layers.2.mixer"].pool
      ([65536, 65536], 0)
    """
    pools, views = planned_pools(
        kv_cache_config,
        vllm_config,
        kernel_block_sizes,
        attn_groups,
        storage=storage,
        pool_dtype=pool_dtype,
    )
    return KVCacheInit(pools=allocate_pools(pools, sharding), kv_caches=views)


def planned_pools(
    kv_cache_config: KVCacheConfig,
    runner_config: RunnerConfig,
    kernel_block_sizes: Sequence[int],
    attn_groups: Sequence[Sequence[AttentionGroup]],
    *,
    storage: str = "words",
    pool_dtype: str = "auto",
    max_flat_words: int = 2**31,
) -> PlannedPools:
    """The pools and views :func:`init_kv_cache` would create, allocating nothing.

    `storage`, `pool_dtype` and `max_flat_words` are as in :func:`plan_pools`.

    Raises:
      ValueError: If `kernel_block_sizes` disagree with the groups (see
        :func:`check_kernel_block_sizes`).
    """
    check_kernel_block_sizes(kv_cache_config, kernel_block_sizes, attn_groups)
    views = build_kv_cache_views(
        kv_cache_config, runner_config, kernel_block_sizes, attn_groups
    )
    # Kernel views made at bind time need the same word width.
    extra = kernel_views(
        views, attn_groups, kv_cache_config, runner_config, skip_unmapped=True
    ).values()
    return plan_pools(
        kv_cache_config,
        views,
        extra,
        storage=storage,
        pool_dtype=pool_dtype,
        max_flat_words=max_flat_words,
    )
