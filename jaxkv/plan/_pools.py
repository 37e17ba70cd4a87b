"""Physical pools: carrier words, allocation, the seed's init_kv_cache (spec §1.4)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import KVCacheConfig
from jaxkv.plan._layer_views import pool_index
from jaxkv.plan._storage import (
    carrier_dtype,
    granule,
    is_dense,
    row_fits,
    slot_shape,
    storage_dtype,
)
from jaxkv.plan._views import KVCacheView, LayerView, MambaView

STORAGES = ("auto", "words", "typed", "stacked")
POOL_DTYPES = ("auto", "element", "bits")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """One physical pool: a flat array of carrier words, or a typed array.

    A word pool (``typed_shape is None``) is ``(size_bytes // word,)`` words
    of ``word`` bytes, read through strided byte views; with ``rows`` set it is
    ``(rows, size_bytes // word // rows)``, one row per block, addressed by
    (row, word) so that no index past int32 is formed (pools of 2**31 words
    or more). A typed pool is an
    array of ``typed_dtype`` holding ``layers`` dense layer caches:
    ``(layers, *slot)`` when stacked, the slot itself when it holds one (see
    :mod:`jaxkv.kv._typed`).

    Example:
      >>> import jaxkv
      >>> jaxkv.plan.PoolSpec(size_bytes=1024, word=4).shape
      (256,)
      >>> spec = jaxkv.plan.PoolSpec(size_bytes=2048, word=2,
      ...     typed_shape=(2, 4, 16, 8), typed_dtype="bfloat16", layers=2)
      >>> spec.shape, spec.dtype.name, spec.layers
      ((2, 4, 16, 8), 'bfloat16', 2)
    """

    size_bytes: int
    word: int
    typed_shape: tuple[int, ...] | None = None
    typed_dtype: Any = None
    layers: int = 1
    rows: int = 0

    def __post_init__(self) -> None:
        if self.typed_shape is not None:
            dtype = np.dtype(jnp.dtype(self.typed_dtype))
            object.__setattr__(self, "typed_dtype", dtype)
            object.__setattr__(
                self, "typed_shape", tuple(int(d) for d in self.typed_shape)
            )
            if math.prod(self.typed_shape) * dtype.itemsize != self.size_bytes:
                raise ValueError(
                    f"PoolSpec: typed_shape {self.typed_shape} of {dtype.name} is "
                    f"{math.prod(self.typed_shape) * dtype.itemsize} bytes, not "
                    f"size_bytes={self.size_bytes}."
                )

    @property
    def typed(self) -> bool:
        """Whether the pool is a typed array (layer slots of elements)."""
        return self.typed_shape is not None

    @property
    def dtype(self) -> np.dtype:
        """The array dtype: the carrier word (uint8/16/32) or the typed dtype."""
        return self.typed_dtype if self.typed else carrier_dtype(self.word)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the pool array."""
        if self.typed_shape is not None:
            return self.typed_shape
        if self.rows:
            return (self.rows, self.size_bytes // self.word // self.rows)
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


def resolve_storage(storage: str, pool_dtype: str) -> tuple[str, str]:
    """The storage and pool dtype that ``"auto"`` means on this platform.

    ``storage="auto"`` is ``"words"`` on CPU (XLA:CPU's fastest scatters are
    integer ones; every seed layout) and ``"stacked"`` elsewhere (typed,
    layer-stacked pools: what kernels and layer scans read).
    ``pool_dtype="auto"`` is ``"bits"`` on CPU (XLA:CPU converts narrow-float
    scatters through float32 over the whole pool) and ``"element"`` elsewhere;
    on CPU it applies to floats narrower than 4 bytes only.

    Raises:
      ValueError: For an unknown name.

    Example:
      >>> import jax, jaxkv
      >>> want = {"cpu": ("words", "bits")}.get(jax.default_backend(),
      ...                                       ("stacked", "element"))
      >>> jaxkv.plan.resolve_storage("auto", "auto") == want
      True
      >>> jaxkv.plan.resolve_storage("typed", "element")
      ('typed', 'element')
    """
    if storage not in STORAGES:
        raise ValueError(f"storage={storage!r}, expected one of {STORAGES}.")
    if pool_dtype not in POOL_DTYPES:
        raise ValueError(f"pool_dtype={pool_dtype!r}, expected one of {POOL_DTYPES}.")
    cpu = jax.default_backend() == "cpu"
    if storage == "auto":
        storage = "words" if cpu else "stacked"
    if pool_dtype == "auto":
        pool_dtype = "bits" if cpu else "element"
    return storage, pool_dtype


def _stores_bits(dtype: np.dtype, pool_dtype: str) -> bool:
    if pool_dtype == "element":
        return False
    if jax.default_backend() != "cpu":
        return True
    # On CPU only narrow floats pay for native scatters.
    return bool(jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4)


def _typed_dtype(views: Sequence[LayerView], size: int) -> np.dtype | None:
    """The element dtype if the pool can be a typed array, else None.

    The element dtype if every view of the pool is a dense attention view
    over all of it with one dtype (so the pool can be a typed array), else None.
    """
    dtypes = set()
    for view in views:
        if not isinstance(view, KVCacheView) or view.owned is not None:
            return None
        if view.offset or view.nbytes != size:
            return None
        if not is_dense(view.shape, view.strides):
            return None
        dtypes.add(view.dtype)
    return dtypes.pop() if len(dtypes) == 1 else None


def _rows(views: Sequence[LayerView], size: int, word: int, num_blocks: int) -> int:
    """Rows of one block each for a word pool, or 0 if a view's blocks cross rows."""
    if num_blocks < 1 or size % num_blocks or (size // num_blocks) % word:
        return 0
    row = size // num_blocks
    for view in views:
        for v in view.states if isinstance(view, MambaView) else (view,):
            if not row_fits(v.offset, v.shape, v.strides, v.itemsize, v.block_dim, row):
                return 0
    return num_blocks


def _signature(view: KVCacheView) -> tuple[Any, ...]:
    return (view.shape, view.strides, view.dtype, view.axes, view.head_size)


class PlannedPools(NamedTuple):
    """What :func:`planned_pools` and :func:`plan_pools` return.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> jaxkv.plan.planned_pools(kv, cfg, sizes, groups).pools[0].size_bytes
      65536
    """

    pools: tuple[PoolSpec, ...]
    """Each pool's size and carrier word."""
    views: dict[str, LayerView]
    """``layer -> view`` with the words set."""


def plan_pools(
    kv_cache_config: KVCacheConfig,
    views: Mapping[str, LayerView],
    extra_views: Iterable[LayerView] = (),
    *,
    max_word: int = 4,
    storage: str = "words",
    pool_dtype: str = "auto",
    max_flat_words: int = 2**31,
) -> PlannedPools:
    """Chooses each pool's storage and stamps it on the views.

    A word pool's word is the widest of 4, 2, 1 bytes dividing the pool size
    and every window start and length of every view's block and token
    accesses: wide words make XLA:CPU scatters several times faster than byte
    scatters. With `storage` ``"typed"`` or ``"stacked"``, a pool whose views
    are all dense attention views over the whole pool with one dtype (no
    Mamba state, no padded or packed pages) becomes a typed array; with
    ``"stacked"``, pools whose views agree (shape, strides, dtype) share one
    array, a layer slot each. Everything else stays carrier words; a word pool
    of `max_flat_words` words or more is stored as one row per block (see
    :class:`PoolSpec`) when each view's blocks lie inside rows.

    Returns:
      ``(pool specs, views with their pool, word and layer slot set)``;
      aliased layers keep sharing one view object.

    Raises:
      ValueError: If a word pool of 2**31 words or more cannot be stored in
        rows (a dense K/V-first layer: its K and V halves are a pool apart).
    """
    storage, pool_dtype = resolve_storage(storage, pool_dtype)
    sizes, of_tensor = pool_index(kv_cache_config)
    packed = {
        of_tensor[t]
        for t, x in enumerate(kv_cache_config.kv_cache_tensors)
        if x.is_packed
    }
    g = list(sizes)
    on_pool: dict[int, dict[int, LayerView]] = {i: {} for i in range(len(sizes))}
    for view in (*views.values(), *extra_views):
        pool = view.pool
        g[pool] = math.gcd(g[pool], *_view_granules(view))
        on_pool[pool][id(view)] = view
    words = [next(w for w in (4, 2, 1) if w <= max_word and gv % w == 0) for gv in g]
    # old pool -> (new pool, layer slot or None)
    where: dict[int, tuple[int, int | None]] = {}
    specs: list[dict[str, Any]] = []
    stacks: dict[Any, int] = {}
    for old, size in enumerate(sizes):
        dtype = None
        if storage != "words" and old not in packed and on_pool[old]:
            dtype = _typed_dtype(list(on_pool[old].values()), size)
        if dtype is None:
            where[old] = (len(specs), None)
            specs.append(
                _word_pool(
                    size,
                    words[old],
                    list(on_pool[old].values()),
                    num_blocks=kv_cache_config.num_blocks,
                    max_flat_words=max_flat_words,
                )
            )
            continue
        first = next(iter(on_pool[old].values()))
        if not isinstance(first, KVCacheView):  # unreachable: _typed_dtype checked
            raise TypeError(f"Pool {old} has a non-attention view.")
        key: Any = (
            (size, dtype, frozenset(_signature(v) for v in on_pool[old].values()))  # pyright: ignore[reportArgumentType]
            if storage == "stacked"
            else ("own", old)
        )
        if key not in stacks:
            stacks[key] = len(specs)
            specs.append(_typed_pool(first, dtype, pool_dtype))
        new = stacks[key]
        where[old] = (new, specs[new]["layers"])
        specs[new]["layers"] += 1
        specs[new]["size_bytes"] += size
    pools = []
    for spec in specs:
        if "layers" in spec and storage == "stacked":
            spec = dict(spec, typed_shape=(spec["layers"], *spec["typed_shape"]))
        pools.append(PoolSpec(**spec))
    stamped: dict[int, LayerView] = {}
    out: dict[str, LayerView] = {}
    for name, view in views.items():
        if id(view) not in stamped:
            new, layer = where[view.pool]
            stamped[id(view)] = _stamp(
                view, new, words[view.pool], layer, sizes[view.pool]
            )
        out[name] = stamped[id(view)]
    return PlannedPools(pools=tuple(pools), views=out)


def _typed_pool(view: KVCacheView, dtype: np.dtype, pool_dtype: str) -> dict[str, Any]:
    """A typed pool's spec fields, before its layers are counted."""
    return dict(
        size_bytes=0,
        word=dtype.itemsize,
        typed_shape=slot_shape(view),
        typed_dtype=storage_dtype(dtype, _stores_bits(dtype, pool_dtype)),
        layers=0,
    )


def _word_pool(
    size: int,
    word: int,
    views: Sequence[LayerView],
    *,
    num_blocks: int,
    max_flat_words: int,
) -> dict[str, Any]:
    """A carrier-word pool's spec fields: flat, or one row per block.

    Rows per block when it has `max_flat_words` words or more and its views
    allow it.
    """
    rows = 0
    if size // word >= max_flat_words:
        rows = _rows(views, size, word, num_blocks)
    if not rows and size // word >= 2**31:
        raise ValueError(
            f"A pool of {size} bytes has {size // word} {word}-byte words, past "
            "int32 indexing, and its views cannot be stored one block per row; "
            "plan it with storage='typed' or 'stacked' (typed pools index blocks, "
            "not words), or split it into several KVCacheTensors."
        )
    return dict(size_bytes=size, word=word, rows=rows)


def _stamp(
    view: LayerView, pool: int, word: int, layer: int | None, slot_bytes: int
) -> LayerView:
    if layer is None:
        if isinstance(view, MambaView):
            return MambaView(
                states=tuple(
                    dataclasses.replace(s, word=word, pool=pool) for s in view.states
                )
            )
        return dataclasses.replace(view, word=word, pool=pool)
    if not isinstance(view, KVCacheView):  # unreachable: typed pools hold attention
        raise TypeError(f"A {type(view).__name__} cannot view a typed pool.")
    return dataclasses.replace(
        view, pool=pool, word=view.itemsize, layer=layer, offset=layer * slot_bytes
    )
