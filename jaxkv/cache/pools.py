"""Physical pools: carrier words, allocation, the seed's init_kv_cache (spec §1.4)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.kernel_views import kernel_views
from jaxkv.cache.layout import build_kv_cache_views, pool_index
from jaxkv.cache.strided import carrier_dtype, granule
from jaxkv.cache.views import LayerView, MambaView
from jaxkv.config import RunnerConfig
from jaxkv.groups.attn_group import AttentionGroup
from jaxkv.groups.init_backend import check_kernel_block_sizes
from jaxkv.kv_cache_config import KVCacheConfig


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """One physical pool: a flat array of carrier words.

    Example:
      >>> import jaxkv
      >>> jaxkv.PoolSpec(size_bytes=1024, word=4).shape
      (256,)
    """

    size_bytes: int
    word: int

    @property
    def dtype(self) -> np.dtype:
        """The carrier dtype (uint8, uint16 or uint32)."""
        return carrier_dtype(self.word)

    @property
    def shape(self) -> tuple[int]:
        """Shape of the pool array."""
        return (self.size_bytes // self.word,)


def _view_granules(view: LayerView) -> list[int]:
    if isinstance(view, MambaView):
        return [
            granule(s.offset, s.shape, s.strides, s.itemsize, (s.block_dim,))
            for s in view.states
        ]
    out = [
        granule(view.offset, view.shape, view.strides, view.itemsize, (view.block_dim,))
    ]
    if "token" in view.axes:
        indexed = (view.block_dim, view.dim("token"))
        out.append(
            granule(view.offset, view.shape, view.strides, view.itemsize, indexed)
        )
    return out


def plan_pools(
    kv_cache_config: KVCacheConfig,
    views: Mapping[str, LayerView],
    extra_views: Iterable[LayerView] = (),
    *,
    max_word: int = 4,
) -> PoolLayout:
    """Chooses each pool's carrier word and stamps it on the views.

    The word is the widest of 4, 2, 1 bytes dividing the pool size and every
    window start and length of every view's block and token accesses: wide
    words make XLA:CPU scatters several times faster than byte scatters.

    Returns:
      ``(pool specs, views with their word set)``; aliased layers keep sharing
      one view object.
    """
    sizes, _ = pool_index(kv_cache_config)
    g = [s for s in sizes]
    for view in (*views.values(), *extra_views):
        pool = view.pool
        g[pool] = math.gcd(g[pool], *_view_granules(view))
    words = [next(w for w in (4, 2, 1) if w <= max_word and gv % w == 0) for gv in g]
    for size, word in zip(sizes, words, strict=True):
        if size // word >= 2**31:
            raise ValueError(
                f"A pool of {size} bytes has {size // word} {word}-byte words, past "
                "int32 indexing; split it into several KVCacheTensors."
            )
    stamped: dict[int, LayerView] = {}
    out: dict[str, LayerView] = {}
    for name, view in views.items():
        if id(view) not in stamped:
            stamped[id(view)] = with_word(view, words[view.pool])
        out[name] = stamped[id(view)]
    pools = tuple(
        PoolSpec(size_bytes=s, word=w) for s, w in zip(sizes, words, strict=True)
    )
    return PoolLayout(pools=pools, views=out)


def with_word(view: LayerView, word: int) -> LayerView:
    """`view` with its pool's carrier word set."""
    if isinstance(view, MambaView):
        return MambaView(
            states=tuple(dataclasses.replace(s, word=word) for s in view.states)
        )
    return dataclasses.replace(view, word=word)


def allocate_pools(
    pools: Sequence[PoolSpec], sharding: jax.sharding.Sharding | None = None
) -> tuple[jax.Array, ...]:
    """Zero-initialised pools, created under jit (no host-sized array).

    Example:
      >>> import jaxkv
      >>> (pool,) = jaxkv.allocate_pools([jaxkv.PoolSpec(size_bytes=64, word=4)])
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
      >>> kv = jaxkv.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.init_attn_backend(kv, cfg)
      >>> init = jaxkv.init_kv_cache(kv, cfg, sizes, groups)
      >>> len(init.pools), init.kv_caches["layers.0.self_attn"].pool
      (2, 0)
    """

    pools: tuple[jax.Array, ...]
    """One zeroed array per pool."""
    kv_caches: dict[str, LayerView]
    """``layer -> view`` of those pools."""


class PoolLayout(NamedTuple):
    """What :func:`plan_kv_cache` and :func:`plan_pools` return.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.init_attn_backend(kv, cfg)
      >>> jaxkv.plan_kv_cache(kv, cfg, sizes, groups).pools[0].size_bytes
      65536
    """

    pools: tuple[PoolSpec, ...]
    """Each pool's size and carrier word."""
    views: dict[str, LayerView]
    """``layer -> view`` with the words set."""


def init_kv_cache(
    kv_cache_config: KVCacheConfig,
    vllm_config: RunnerConfig,
    kernel_block_sizes: Sequence[int],
    attn_groups: Sequence[Sequence[AttentionGroup]],
    *,
    sharding: jax.sharding.Sharding | None = None,
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

    Returns:
      ``(pools, kv_caches)`` (a :class:`KVCacheInit`): the pool arrays and
      ``layer -> view``.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.init_kv_cache(kv, cfg, sizes, groups)
      >>> [p.nbytes for p in pools], views["layers.2.mixer"].pool
      ([65536, 65536], 0)
    """
    pools, views = plan_kv_cache(
        kv_cache_config, vllm_config, kernel_block_sizes, attn_groups
    )
    return KVCacheInit(pools=allocate_pools(pools, sharding), kv_caches=views)


def plan_kv_cache(
    kv_cache_config: KVCacheConfig,
    vllm_config: RunnerConfig,
    kernel_block_sizes: Sequence[int],
    attn_groups: Sequence[Sequence[AttentionGroup]],
) -> PoolLayout:
    """The pools and views :func:`init_kv_cache` would create, allocating nothing.

    Raises:
      ValueError: If `kernel_block_sizes` disagree with the groups (see
        :func:`check_kernel_block_sizes`).
    """
    check_kernel_block_sizes(kv_cache_config, kernel_block_sizes, attn_groups)
    views = build_kv_cache_views(
        kv_cache_config, vllm_config, kernel_block_sizes, attn_groups
    )
    # Kernel views made at bind time need the same word width.
    extra = kernel_views(
        views, attn_groups, kv_cache_config, vllm_config, skip_unmapped=True
    ).values()
    return plan_pools(kv_cache_config, views, extra)
