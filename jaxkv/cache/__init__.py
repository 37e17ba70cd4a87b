"""cache: the plan, the pools, every layer's view of them, reads and writes.

Data flow inside: ``_grouping`` (layers into groups and pools, vLLM's hybrid
page alignment) -> ``_pools`` (carrier-word or typed storage, allocation) ->
``_layer_views`` / ``_kernel_views`` / ``_views`` (each layer's bytes) ->
``_bind`` (views bound to attention layers) -> ``_plan`` (all of it as one
static, hashable :class:`KVCachePlan`) and ``_shard`` (on a mesh);
``_ops`` writes and gathers K/V through views inside jit (``_strided`` for
word pools, ``_typed`` for typed pools), ``_state_ops`` Mamba states, zeroing
and whole-view reads, ``_kernel_handoff`` a layer's cache as a kernel's array,
``_checks`` the host-side id checks they share; ``_vllm_layout`` is vLLM 0.33's
description of the same storage; ``_blocks`` a block allocator.
"""  # noqa: D205

from jaxkv.cache._allocate import (
    KVCacheInit,
    allocate_pools,
    init_kv_cache,
    pool_layout,
)
from jaxkv.cache._bind import (
    AttentionLayer,
    BoundKVCaches,
    bind_kv_caches,
    build_slot_mappings_by_layer,
    local_attention,
)
from jaxkv.cache._blocks import BlockAllocator, get_num_skipped_tokens
from jaxkv.cache._checks import (
    Pools,
    any_deleted,
    check_fits,
    check_layer,
    check_pools_alive,
    layer_index,
    validate_block_ids,
    validate_slot_mapping,
)
from jaxkv.cache._grouping import (
    HybridBlockAlignment,
    align_hybrid_block_size,
    make_kv_cache_config,
    unify_page_sizes,
)
from jaxkv.cache._kernel_handoff import kernel_cache, put_kernel_cache
from jaxkv.cache._layer_views import build_kv_cache_views
from jaxkv.cache._make_plan import KVCacheBudget, kv_cache_budget, make_plan
from jaxkv.cache._mixed_layouts import (
    _align_mixed_attention_kv_cache_views,  # noqa: F401  (vLLM's name)
    _kv_first_layers_sharing_pool_with_mamba,  # noqa: F401  (vLLM's name)
)
from jaxkv.cache._ops import gather_kv_pages, write_kv
from jaxkv.cache._page_layout import PageLayout, page_layout, pallas_view_unfit
from jaxkv.cache._plan import KVCachePlan, LayerStack
from jaxkv.cache._pools import PoolLayout, PoolSpec, resolve_storage
from jaxkv.cache._raw_address import raw_address, raw_unfit
from jaxkv.cache._shard import (
    ShardedPlan,
    local_kv_heads,
    local_runner_config,
    shard_plan,
)
from jaxkv.cache._state_ops import (
    read_mamba_state,
    read_view,
    write_mamba_state,
    zero_blocks,
)
from jaxkv.cache._views import KVCacheView, LayerView, MambaView
from jaxkv.cache._vllm_layout import (
    LayerTensor,
    TensorLayout,
    hnc_shape,
    layout_strides,
    resolve_layout,
)
from jaxkv.cache._vllm_tensors import (
    allocate_layer_tensors,
    layout_of_view,
    plan_tensors,
    tensor_views,
)

__all__ = [
    "AttentionLayer",
    "BlockAllocator",
    "BoundKVCaches",
    "HybridBlockAlignment",
    "KVCacheBudget",
    "KVCacheInit",
    "KVCachePlan",
    "KVCacheView",
    "LayerStack",
    "LayerTensor",
    "LayerView",
    "MambaView",
    "PageLayout",
    "PoolLayout",
    "PoolSpec",
    "Pools",
    "ShardedPlan",
    "TensorLayout",
    "align_hybrid_block_size",
    "allocate_layer_tensors",
    "allocate_pools",
    "any_deleted",
    "bind_kv_caches",
    "build_kv_cache_views",
    "build_slot_mappings_by_layer",
    "check_fits",
    "check_layer",
    "check_pools_alive",
    "gather_kv_pages",
    "get_num_skipped_tokens",
    "hnc_shape",
    "init_kv_cache",
    "kernel_cache",
    "kv_cache_budget",
    "layer_index",
    "layout_of_view",
    "layout_strides",
    "local_attention",
    "local_kv_heads",
    "local_runner_config",
    "make_kv_cache_config",
    "make_plan",
    "page_layout",
    "pallas_view_unfit",
    "plan_tensors",
    "pool_layout",
    "put_kernel_cache",
    "raw_address",
    "raw_unfit",
    "read_mamba_state",
    "read_view",
    "resolve_layout",
    "resolve_storage",
    "shard_plan",
    "tensor_views",
    "unify_page_sizes",
    "validate_block_ids",
    "validate_slot_mapping",
    "write_kv",
    "write_mamba_state",
    "zero_blocks",
]
