"""vLLM's names for jaxkv's machinery, in vLLM's argument order.

A vLLM user porting a model runner looks for ``init_attn_backend``,
``bind_kv_caches``, ``build_attn_metadata`` and the rest of
``vllm/v1/worker/gpu/attn_utils.py``; they are here, with the records and
specs those signatures take, under vLLM's names. Each is jaxkv's own
implementation (no second code path): the plan-first API in :mod:`jaxkv`
(:func:`jaxkv.make_plan`) calls the same functions. The names also resolve
as attributes of :mod:`jaxkv` itself.

Which vLLM each follows:

* vLLM 0.32 (the seeds, pre-refactor ``attn_utils``): ``init_attn_backend``,
  ``init_kv_cache``, ``bind_kv_caches``, ``build_attn_metadata``,
  ``get_attn_cg_support``, ``get_kv_sharing_fast_prefill_eligible_layers``,
  ``get_query_lens_mismatch_unsupported_backend``,
  ``get_varlen_cudagraph_unsupported_backend``, ``FastPrefillHelper``,
  ``FastPrefillBatchMetadata``, ``compute_mm_prefix_ranges``,
  ``_align_mixed_attention_kv_cache_views``,
  ``_kv_first_layers_sharing_pool_with_mamba``; ``vllm/v1/core``'s
  ``KVCacheConfig``, ``KVCacheTensor(size, shared_by)``, ``KVCacheGroupSpec``,
  ``unify_page_sizes`` and the specs (``kv_cache_interface``).
* vLLM 0.33 (the layout refactor): ``TensorLayout``, ``LayerTensor``,
  ``hnc_shape``, ``layout_strides``, ``resolve_layout``, ``tensor_views``,
  ``layout_of_view``, ``allocate_layer_tensors``, ``plan_tensors``,
  ``copy_kv_cache_blocks`` (``copy_kv_cache_blocks_inplace``, functional).

Example (the seeds' flow: groups, then pools and views, then binding):
  >>> import jaxkv, jaxkv.vllm as vllm
  >>> cfg = jaxkv.tiny_hybrid_config()
  >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
  >>> groups, info, sizes = vllm.init_attn_backend(kv, cfg)
  >>> pools, views = vllm.init_kv_cache(kv, cfg, sizes, groups)
  >>> bound = vllm.bind_kv_caches(views, ["layers.3.self_attn",
  ...     "layers.6.self_attn"], kv, cfg, groups)
  >>> bound["layers.6.self_attn"] is bound["layers.3.self_attn"]  # YOCO
  True
"""

from jaxkv.config import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    add_kv_sharing_layers_to_kv_cache_groups,
    create_fast_prefill_custom_backend,
    get_kv_cache_spec,
    get_kv_sharing_fast_prefill_eligible_layers,
    get_num_skipped_tokens,
    get_shared_kv_cache_layers,
)
from jaxkv.groups import (
    AttentionCGSupportInfo,
    AttentionGroup,
    AttnBackendInit,
    get_attn_cg_support,
    get_query_lens_mismatch_unsupported_backend,
    get_varlen_cudagraph_unsupported_backend,
    init_attn_backend,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from jaxkv.kv import copy_kv_cache_blocks
from jaxkv.plan import (
    AttentionLayer,
    BoundKVCaches,
    KVCacheInit,
    LayerTensor,
    TensorLayout,
    _align_mixed_attention_kv_cache_views,
    _kv_first_layers_sharing_pool_with_mamba,
    allocate_layer_tensors,
    bind_kv_caches,
    build_slot_mappings_by_layer,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    hnc_shape,
    init_kv_cache,
    is_kv_cache_spec_uniform,
    layout_of_view,
    layout_strides,
    max_memory_usage_bytes,
    merge_specs,
    plan_tensors,
    resolve_layout,
    tensor_views,
    unify_hybrid_kv_cache_specs,
    unify_page_sizes,
)
from jaxkv.step import (
    BatchDescriptor,
    CommonAttentionMetadata,
    CompileMode,
    FastPrefillBatchMetadata,
    FastPrefillHelper,
    MultiModalFeatureSpec,
    PlaceholderRange,
    build_attn_metadata,
    compute_mm_prefix_ranges,
    make_kv_sharing_fast_prefill_common_attn_metadata,
)

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionCGSupportInfo",
    "AttentionGroup",
    "AttentionLayer",
    "AttentionSpec",
    "AttnBackendInit",
    "BatchDescriptor",
    "BoundKVCaches",
    "ChunkedLocalAttentionSpec",
    "CommonAttentionMetadata",
    "CompileMode",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FastPrefillBatchMetadata",
    "FastPrefillHelper",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheInit",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCacheTensor",
    "LayerTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "MultiModalFeatureSpec",
    "MultipleOf",
    "PlaceholderRange",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "TensorLayout",
    "UniformTypeKVCacheSpecs",
    "_align_mixed_attention_kv_cache_views",
    "_kv_first_layers_sharing_pool_with_mamba",
    "add_kv_sharing_layers_to_kv_cache_groups",
    "allocate_layer_tensors",
    "bind_kv_caches",
    "build_attn_metadata",
    "build_slot_mappings_by_layer",
    "compute_mm_prefix_ranges",
    "copy_kv_cache_blocks",
    "create_fast_prefill_custom_backend",
    "get_attn_cg_support",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_configs",
    "get_kv_cache_groups",
    "get_kv_cache_spec",
    "get_kv_sharing_fast_prefill_eligible_layers",
    "get_max_concurrency_for_kv_cache_config",
    "get_num_skipped_tokens",
    "get_query_lens_mismatch_unsupported_backend",
    "get_shared_kv_cache_layers",
    "get_varlen_cudagraph_unsupported_backend",
    "hnc_shape",
    "init_attn_backend",
    "init_kv_cache",
    "is_kv_cache_spec_uniform",
    "layout_of_view",
    "layout_strides",
    "make_kv_sharing_fast_prefill_common_attn_metadata",
    "max_memory_usage_bytes",
    "merge_specs",
    "plan_tensors",
    "prepare_kernel_block_sizes",
    "resolve_layout",
    "select_common_block_size",
    "tensor_views",
    "unify_hybrid_kv_cache_specs",
    "unify_page_sizes",
]
