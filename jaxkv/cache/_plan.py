"""One static plan: from a runner config and a block count (or a byte budget) to
groups, kernel block sizes, compile support, pools and every layer's view.
"""  # noqa: D205

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxkv._config import RunnerConfig
from jaxkv._kv_cache_config import KVCacheConfig
from jaxkv._specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    MambaSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from jaxkv._util import cdiv, check_positive_int
from jaxkv.cache._bind import (
    AttentionLayer,
    BoundKVCaches,
    attention_layer,
    bind_kv_caches,
)
from jaxkv.cache._grouping import (
    align_hybrid_block_size,
    make_kv_cache_config,
    unify_page_sizes,
)
from jaxkv.cache._pools import (
    PoolSpec,
    allocate_pools,
    pool_layout,
    resolve_storage,
)
from jaxkv.groups import (
    AttentionCGSupportInfo,
    AttentionGroup,
    init_attn_backend,
    with_kv_sharing_layers,
)


class LayerStack(NamedTuple):
    """What :meth:`KVCachePlan.layer_stack` returns.

    Attributes:
      layer: The first layer's :class:`AttentionLayer`; with ``layer=slots[i]``
        every read, write and :func:`paged_attention` addresses ``names[i]``.
      slots: ``(len(names),)`` int32 layer slots in the stacked pool.
      names: The layers, in scan order.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2),
      ...                        num_blocks=4, storage="stacked")
      >>> stack = plan.layer_stack(["layers.1.self_attn", "layers.0.self_attn"])
      >>> stack.slots.tolist(), stack.layer.name
      ([1, 0], 'layers.1.self_attn')
    """

    layer: AttentionLayer
    slots: np.ndarray
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class KVCachePlan:
    """Everything static about a model's KV cache, computed once.

    Built by :func:`make_plan`; later calls (:meth:`allocate`,
    :class:`StepMetadataBuilder`, the demo Engine) take the plan instead of the
    four objects it holds. Equal and hashed by value (its attention groups,
    identity-equal as in vLLM, by their fields), so it can be a static argument
    of ``jax.jit`` and a plan built again from the same arguments is the same
    key: no recompile. Nothing here is an array.

    Attributes:
      runner_config: The model's layers and limits.
      kv_cache_config: Pools and groups, KV-sharing layers included.
      attn_groups: Attention groups per KV-cache group.
      kernel_block_sizes: Kernel block size per KV-cache group (up to the first
        encoder-only group).
      cg_support: The weakest compile support of the model's backends.
      pools: Shape, dtype and carrier word of each physical pool.
      views: Every cached layer's view (KV-sharing layers alias their target's).
      storage: How pools are stored (resolved: ``"words"``, ``"typed"`` or
        ``"stacked"``; see :func:`make_plan`).
      pool_dtype: ``"native"`` or ``"bits"`` (typed pools of narrow floats).

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> [p.size_bytes for p in plan.pools], plan.block_table_widths
      ([65536, 65536], (128, 128, 128))
      >>> plan.views["layers.6.self_attn"] is plan.views["layers.3.self_attn"]
      True
    """

    runner_config: RunnerConfig
    kv_cache_config: KVCacheConfig
    attn_groups: tuple[tuple[AttentionGroup, ...], ...]
    kernel_block_sizes: tuple[int, ...]
    cg_support: AttentionCGSupportInfo
    pools: tuple[PoolSpec, ...]
    views: BoundKVCaches
    storage: str = "words"
    pool_dtype: str = "bits"

    @functools.cached_property
    def _key(self) -> tuple[Any, ...]:
        groups = tuple(
            tuple(tuple(getattr(g, f.name) for f in dataclasses.fields(g)) for g in gs)
            for gs in self.attn_groups
        )
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return tuple(groups if f is self.attn_groups else f for f in fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVCachePlan):
            return NotImplemented
        return self is other or self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def num_blocks(self) -> int:
        """Blocks per pool (block 0 is the null block)."""
        return self.kv_cache_config.num_blocks

    @functools.cached_property
    def block_sizes(self) -> tuple[int, ...]:
        """Tokens per manager block, per KV-cache group."""
        return tuple(
            g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups
        )

    @functools.cached_property
    def block_table_widths(self) -> tuple[int, ...]:
        """Block-table columns per KV-cache group for ``max_model_len`` tokens:
        ``ceil(max_model_len / block_size)``.

        A Mamba group has a column per block too: the state after a request's
        last computed token lives in that token's column (see
        :class:`KVCacheManager`); a Mamba spec whose block size is at least
        ``max_model_len`` has one column.
        """  # noqa: D205
        return tuple(
            cdiv(self.runner_config.max_model_len, g.kv_cache_spec.block_size)
            for g in self.kv_cache_config.kv_cache_groups
        )

    @functools.cached_property
    def group_kinds(self) -> tuple[str, ...]:
        """What each KV-cache group keeps of a sequence (for the block manager
        and the step checks).

        - ``"full"``: every block of the context (full attention, or a group
          that a layer without the group's window also reads);
        - ``"window"``: the blocks a sliding window or local chunk still shows;
        - ``"mamba"``: the block of the last computed token's state;
        - ``"encoder"``: cross-attention and encoder-only K/V, addressed by
          encoder positions.

        Example:
          >>> import jaxkv
          >>> jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4).group_kinds
          ('full', 'window', 'mamba')
        """  # noqa: D205
        cfg = self.runner_config
        kinds = []
        for g in self.kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            own = all(cfg.layer(n).spec == spec for n in g.layer_names)
            if isinstance(spec, MambaSpec):
                kinds.append("mamba")
            elif isinstance(spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
                kinds.append("encoder")
            elif own and isinstance(
                spec,
                SlidingWindowSpec | SlidingWindowMLASpec | ChunkedLocalAttentionSpec,
            ):
                kinds.append("window")
            else:
                kinds.append("full")
        return tuple(kinds)

    def attention_layer(self, name: str) -> AttentionLayer:
        """`name`'s bound view with its spec's attention parameters
        (:class:`AttentionLayer`), for :func:`paged_attention`.
        """  # noqa: D205
        return attention_layer(self.views, self.runner_config, name)

    def layer_stack(self, names: Sequence[str]) -> LayerStack:
        """The layers `names` as one stack to ``lax.scan`` over.

        Every layer must be an attention layer of one stacked typed pool
        (``storage="stacked"``) with the same view and attention parameters
        but for its slot, so one :class:`AttentionLayer` serves them all and
        ``slots[i]`` (traced inside the scan) picks layer ``names[i]``.

        Raises:
          ValueError: If the layers live in different pools, in a word pool,
            or differ in view or attention parameters (naming the first two
            that disagree).

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=3),
          ...                        num_blocks=4, storage="stacked")
          >>> stack = plan.layer_stack([f"layers.{i}.self_attn" for i in range(3)])
          >>> stack.slots.tolist(), stack.layer.view.pool
          ([0, 1, 2], 0)
        """
        names = list(names)
        if not names:
            raise ValueError("layer_stack: names is empty.")
        layers = [self.attention_layer(n) for n in names]
        first = layers[0]
        if not first.view.typed:
            raise ValueError(
                f"layer_stack: layer {first.name!r} lives in a word pool; plan with "
                f"storage='stacked' (this plan's storage is {self.storage!r})."
            )
        base = dataclasses.replace(
            first, view=dataclasses.replace(first.view, layer=0, offset=0)
        )
        for layer in layers[1:]:
            other = dataclasses.replace(
                layer,
                name=first.name,
                view=dataclasses.replace(layer.view, layer=0, offset=0),
            )
            if other != base:
                raise ValueError(
                    f"layer_stack: layers {first.name!r} and {layer.name!r} cannot be "
                    "scanned together: they differ in pool, view or attention "
                    "parameters (window, chunk, soft cap); scan each kind of layer "
                    "on its own."
                )
        return LayerStack(
            layer=first,
            slots=np.asarray([layer.view.layer for layer in layers], np.int32),
            names=tuple(names),
        )

    @property
    def pool_bytes(self) -> int:
        """Bytes of all pools together."""
        return sum(p.size_bytes for p in self.pools)

    def allocate(
        self, *, sharding: jax.sharding.Sharding | None = None
    ) -> tuple[jax.Array, ...]:
        """Zero-initialised pool arrays, made under jit (see :func:`allocate_pools`).

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
          >>> [p.shape for p in plan.allocate()]
          [(16384,), (16384,)]
        """
        return allocate_pools(self.pools, sharding)


def make_plan(
    runner_config: RunnerConfig,
    *,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    packed: bool = False,
    maps_slot_mapping: bool = False,
    align_hybrid: bool = False,
    storage: str = "auto",
    pool_dtype: str = "auto",
) -> KVCachePlan:
    """Plans a model's KV cache: groups, kernel blocks, pools and views.

    Exactly one of `num_blocks` and `memory_bytes` is given. With a byte budget
    the plan is probed with one block, and the budget divided by the bytes one
    block costs over all pools gives the block count (rounded down).

    Args:
      runner_config: The model's layers and limits.
      num_blocks: Blocks per pool, the null block 0 included.
      memory_bytes: Or a budget for all pools together, in bytes.
      packed: Pack the pools into one backing (see :func:`make_kv_cache_config`).
      maps_slot_mapping: The caller maps its slot mappings to kernel blocks
        (see :func:`init_attn_backend`).
      align_hybrid: First raise the attention block size and pad the Mamba
        pages so both share pages (:func:`align_hybrid_block_size`); the plan's
        ``runner_config`` is then the aligned one (build the model from it).
        Attention layers with smaller pages than the largest are always unified
        as vLLM does (:func:`unify_page_sizes`: more tokens per block, or a
        padded page), so read block sizes from ``plan.runner_config``.
      storage: How pools are stored. ``"words"``: flat arrays of carrier words
        (uint32 where alignment allows), every layout and every sharing of
        bytes between layers of different dtypes or shapes. ``"typed"``: a
        pool whose views are dense attention caches of one dtype becomes an
        element-typed array ``(1, *layer cache)`` (one per KV-cache tensor:
        what a write-fused kernel takes and returns in place). ``"stacked"``:
        as typed, and the tensors whose layers agree in shape share one array
        ``(L, *layer cache)``; reads, writes and :func:`paged_attention` take
        a traced ``layer=`` (``lax.scan`` over layers). Pools typed storage
        cannot hold (Mamba state, padded or packed pages, mixed dtypes) stay
        words. ``"auto"`` (default): ``"words"`` on CPU, ``"stacked"`` on
        accelerators (:func:`resolve_storage`).
      pool_dtype: What typed pools hold: ``"native"`` (the cache dtype) or
        ``"bits"`` (unsigned integers of its width; XLA:CPU scatters narrow
        floats through float32 over the whole pool). ``"auto"`` (default):
        bits for floats narrower than 4 bytes on CPU, native otherwise.

    Returns:
      The plan.

    Raises:
      ValueError: If neither or both of `num_blocks` and `memory_bytes` are
        given, or the budget holds fewer than two blocks.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> jaxkv.make_plan(cfg, memory_bytes=2**20).num_blocks  # 32 KiB per block
      32
    """
    if (num_blocks is None) == (memory_bytes is None):
        raise ValueError(
            "make_plan: give exactly one of num_blocks and memory_bytes, got "
            f"num_blocks={num_blocks!r}, memory_bytes={memory_bytes!r}."
        )
    storage, pool_dtype = resolve_storage(storage, pool_dtype)
    if align_hybrid:
        runner_config = align_hybrid_block_size(runner_config).runner_config
    runner_config = unify_page_sizes(runner_config)
    if memory_bytes is not None:
        num_blocks = kv_cache_budget(
            runner_config,
            memory_bytes=memory_bytes,
            packed=packed,
            maps_slot_mapping=maps_slot_mapping,
        ).num_blocks
    num_blocks = check_positive_int("make_plan", "num_blocks", num_blocks)
    if num_blocks < 2:
        raise ValueError(
            f"make_plan: num_blocks={num_blocks} holds no usable block; at least 2 "
            "are needed (block 0 is the null block)."
        )
    plan = _build_plan(
        runner_config, num_blocks, packed, maps_slot_mapping, storage, pool_dtype
    )
    _check_slot_range("make_plan", f"num_blocks={num_blocks}", plan)
    return plan


def _check_slot_range(owner: str, given: str, plan: KVCachePlan) -> None:
    """Slot ids (``block * block_size + offset``) travel as int32: refuses a
    block count whose slots would wrap.
    """  # noqa: D205
    tokens = plan.num_blocks * max(plan.block_sizes, default=1)
    if tokens > _INT32_SLOTS:
        raise ValueError(
            f"{owner}: {given} gives {plan.num_blocks} blocks of up to "
            f"{max(plan.block_sizes)} tokens, {tokens} slots; slot ids are int32 "
            f"(at most {_INT32_SLOTS} slots): give fewer blocks or a smaller budget."
        )


_INT32_SLOTS = 2**31


def _build_plan(
    runner_config: RunnerConfig,
    num_blocks: int,
    packed: bool,
    maps_slot_mapping: bool,
    storage: str,
    pool_dtype: str,
) -> KVCachePlan:
    kv = make_kv_cache_config(runner_config, int(num_blocks), packed=packed)
    groups, info, sizes = init_attn_backend(
        kv, runner_config, maps_slot_mapping=maps_slot_mapping
    )
    pools, views = pool_layout(
        kv, runner_config, sizes, groups, storage=storage, pool_dtype=pool_dtype
    )
    bound = bind_kv_caches(
        views, [layer.name for layer in runner_config.layers], kv, runner_config, groups
    )
    return KVCachePlan(
        runner_config=runner_config,
        kv_cache_config=with_kv_sharing_layers(kv, runner_config),
        attn_groups=tuple(tuple(g) for g in groups),
        kernel_block_sizes=tuple(sizes),
        cg_support=info,
        pools=pools,
        views=bound,
        storage=storage,
        pool_dtype=pool_dtype,
    )


class KVCacheBudget(NamedTuple):
    """What a memory budget buys: blocks, and what one block costs.

    Attributes:
      num_blocks: Blocks per pool (the null block 0 included).
      bytes_per_block: Bytes one block costs over all pools.
      pool_bytes_per_block: Bytes one block costs in each pool.
      pool_bytes: Bytes of all pools at `num_blocks` (at most the budget).

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> jaxkv.kv_cache_budget(cfg, memory_bytes=2**20).num_blocks
      32
    """

    num_blocks: int
    bytes_per_block: int
    pool_bytes_per_block: tuple[int, ...]
    pool_bytes: int


def kv_cache_budget(
    runner_config: RunnerConfig,
    *,
    memory_bytes: int,
    packed: bool = False,
    maps_slot_mapping: bool = False,
) -> KVCacheBudget:
    """The blocks a byte budget holds for `runner_config` (all pools together).

    The model is planned with one block; the budget divided by what one block
    costs over all pools, rounded down, is the block count.

    Raises:
      ValueError: If the budget holds fewer than two blocks (block 0 is the
        null block).

    Example:
      >>> import jaxkv
      >>> b = jaxkv.kv_cache_budget(jaxkv.tiny_hybrid_config(), memory_bytes=10**6)
      >>> b.num_blocks, b.bytes_per_block, b.pool_bytes_per_block, b.pool_bytes
      (30, 32768, (16384, 16384), 983040)
    """
    check_positive_int("kv_cache_budget", "memory_bytes", memory_bytes)
    runner_config = unify_page_sizes(runner_config)
    # Storage changes no byte count (typed pools hold the same pages).
    probe = _build_plan(runner_config, 1, packed, maps_slot_mapping, "words", "bits")
    per_pool = tuple(p.size_bytes for p in probe.pools)
    per_block = sum(per_pool)
    num_blocks = memory_bytes // per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_budget: memory_bytes={memory_bytes} holds {num_blocks} blocks "
            f"of {per_block} bytes (all pools); at least 2 are needed (block 0 is the "
            "null block)."
        )
    if num_blocks * max(probe.block_sizes, default=1) > _INT32_SLOTS:
        raise ValueError(
            f"kv_cache_budget: memory_bytes={memory_bytes} holds {num_blocks} blocks "
            f"of up to {max(probe.block_sizes)} tokens, past the int32 slot ids "
            f"(at most {_INT32_SLOTS} slots): give a smaller budget."
        )
    return KVCacheBudget(
        num_blocks=num_blocks,
        bytes_per_block=per_block,
        pool_bytes_per_block=per_pool,
        pool_bytes=num_blocks * per_block,
    )
