"""``make_plan``: a runner config and a block count into a plan.

``make_plan``: a runner config and a block count (or a memory budget) into a
:class:`KVCachePlan`, and the budget arithmetic behind ``memory_bytes``.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxkv._util import check_positive_int
from jaxkv.config import RunnerConfig
from jaxkv.groups import (
    init_attn_backend,
    with_kv_sharing_layers,
)
from jaxkv.plan._allocate import planned_pools
from jaxkv.plan._bind import bind_kv_caches
from jaxkv.plan._grouping import (
    align_hybrid_block_size,
    make_kv_cache_config,
    unify_page_sizes,
)
from jaxkv.plan._plan import KVCachePlan
from jaxkv.plan._pools import resolve_storage


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
      pool_dtype: What typed pools hold: ``"element"`` (the cache dtype) or
        ``"bits"`` (unsigned integers of its width; XLA:CPU scatters narrow
        floats through float32 over the whole pool). ``"auto"`` (default):
        bits for floats narrower than 4 bytes on CPU, native otherwise.

    Returns:
      The plan. A model without cache layers (attention-free) gets vLLM's
      empty config: 1 block and no pools, whatever was asked for.

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
    if not make_kv_cache_config(runner_config, 1).kv_cache_tensors:
        check_positive_int(
            "make_plan",
            "num_blocks" if memory_bytes is None else "memory_bytes",
            num_blocks if memory_bytes is None else memory_bytes,
        )
        return _build_plan(
            runner_config, 1, packed, maps_slot_mapping, storage, pool_dtype
        )
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
    """Refuses a block count whose int32 slot ids would wrap.

    Slot ids (``block * block_size + offset``) travel as int32: refuses a
    block count whose slots would wrap.
    """
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
    pools, views = planned_pools(
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
