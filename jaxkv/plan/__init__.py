"""plan: everything decided on the host before jit, all static and hashable.

Data flow inside: ``_grouping`` (layers into groups and pools, vLLM's hybrid
page alignment) -> ``_pools`` (carrier-word or typed storage; the geometry
in ``_storage``) -> ``_layer_views`` / ``_kernel_views`` / ``_views`` (each
layer's bytes) -> ``_allocate`` (the pool arrays) -> ``_bind`` (views bound
to attention layers) -> ``_plan`` (all of it as one :class:`KVCachePlan`,
built by ``_make_plan``) and ``_shard`` (on a mesh); ``_vllm_layout`` and
``_vllm_tensors`` are vLLM 0.33's description of the same storage. What
runs inside jit on these views is :mod:`jaxkv.kv`.
"""

from jaxkv.plan._allocate import (
    KVCacheInit,
    allocate_pools,
    init_kv_cache,
    planned_pools,
)
from jaxkv.plan._bind import (
    AttentionLayer,
    BoundKVCaches,
    GroupSlots,
    bind_kv_caches,
    build_slot_mappings_by_layer,
    local_attention,
)
from jaxkv.plan._capacity import (
    get_max_concurrency_for_kv_cache_config,
    max_memory_usage_bytes,
)
from jaxkv.plan._grouping import (
    HybridBlockAlignment,
    align_hybrid_block_size,
    get_kv_cache_groups,
    is_kv_cache_spec_uniform,
    make_kv_cache_config,
    merge_specs,
    unify_hybrid_kv_cache_specs,
    unify_page_sizes,
)
from jaxkv.plan._layer_views import (
    build_kv_cache_views,
    packed_view,
)
from jaxkv.plan._make_plan import (
    KVCacheBudget,
    kv_cache_budget,
    make_plan,
)
from jaxkv.plan._mixed_layouts import (
    _align_mixed_attention_kv_cache_views,  # noqa: F401  (vLLM's name)
    _kv_first_layers_sharing_pool_with_mamba,  # noqa: F401  (vLLM's name)
)
from jaxkv.plan._plan import (
    KVCachePlan,
    LayerStack,
)
from jaxkv.plan._pools import (
    PlannedPools,
    PoolSpec,
    resolve_storage,
)
from jaxkv.plan._shard import (
    ShardedPlan,
    local_kv_heads,
    local_runner_config,
    shard_plan,
)
from jaxkv.plan._sizing import KVCacheSizing, size_kv_cache, step_bytes
from jaxkv.plan._storage import (
    bits_dtype,
    carrier_dtype,
    granule,
    is_dense,
    physical_order,
    physical_shape,
    row_fits,
    slot_shape,
    split_dims,
    storage_dtype,
)
from jaxkv.plan._views import (
    KVCacheView,
    LayerView,
    MambaView,
)
from jaxkv.plan._vllm_layout import (
    LayerTensor,
    TensorLayout,
    hnc_shape,
    layout_strides,
    resolve_layout,
)
from jaxkv.plan._vllm_tensors import (
    allocate_layer_tensors,
    layout_of_view,
    plan_tensors,
    tensor_views,
)
from jaxkv.plan._workers import (
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
)

__all__ = [
    "AttentionLayer",
    "BoundKVCaches",
    "GroupSlots",
    "HybridBlockAlignment",
    "KVCacheBudget",
    "KVCacheInit",
    "KVCachePlan",
    "KVCacheSizing",
    "KVCacheView",
    "LayerStack",
    "LayerTensor",
    "LayerView",
    "MambaView",
    "PlannedPools",
    "PoolSpec",
    "ShardedPlan",
    "TensorLayout",
    "align_hybrid_block_size",
    "allocate_layer_tensors",
    "allocate_pools",
    "bind_kv_caches",
    "bits_dtype",
    "build_kv_cache_views",
    "build_slot_mappings_by_layer",
    "carrier_dtype",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_configs",
    "get_kv_cache_groups",
    "get_max_concurrency_for_kv_cache_config",
    "granule",
    "hnc_shape",
    "init_kv_cache",
    "is_dense",
    "is_kv_cache_spec_uniform",
    "kv_cache_budget",
    "layout_of_view",
    "layout_strides",
    "local_attention",
    "local_kv_heads",
    "local_runner_config",
    "make_kv_cache_config",
    "make_plan",
    "max_memory_usage_bytes",
    "merge_specs",
    "packed_view",
    "physical_order",
    "physical_shape",
    "plan_tensors",
    "planned_pools",
    "resolve_layout",
    "resolve_storage",
    "row_fits",
    "shard_plan",
    "size_kv_cache",
    "slot_shape",
    "split_dims",
    "step_bytes",
    "storage_dtype",
    "tensor_views",
    "unify_hybrid_kv_cache_specs",
    "unify_page_sizes",
]
