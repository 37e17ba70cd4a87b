"""jaxkv: paged KV-cache views, attention groups and step metadata for JAX serving.

The core imports jax and numpy only. The layers, bottom to top: static data
(``specs``, ``backends``, ``config``, ``kv_cache_config``, ``layers``, ``mm``);
``groups`` (attention groups, kernel block sizes, compile support); ``cache``
(planning, pools, views, reads and writes, binding, block ids, the plan);
``sched`` (requests, the block manager with prefix caching, the scheduler
with admission and preemption); ``step`` (the metadata record, packing,
building, fast prefill, buckets, compiled programs, the step builder);
``attention``. The demo model and Engine
live in :mod:`jaxkv.demo`, which ``import jaxkv`` does not load.
"""

import importlib.metadata

from jaxkv.attention import (
    paged_attention,
    request_token_rows,
    token_requests_and_positions,
)
from jaxkv.backends import (
    AttentionBackend,
    AttentionCGSupport,
    KVCacheLayout,
    MultipleOf,
    create_fast_prefill_custom_backend,
    get_backend,
    register_backend,
    registered_backends,
)
from jaxkv.cache.bind import (
    AttentionLayer,
    BoundKVCaches,
    bind_kv_caches,
    build_slot_mappings_by_layer,
    local_attention,
)
from jaxkv.cache.blocks import BlockAllocator, get_num_skipped_tokens
from jaxkv.cache.layout import (
    _align_mixed_attention_kv_cache_views,
    _kv_first_layers_sharing_pool_with_mamba,
    build_kv_cache_views,
)
from jaxkv.cache.ops import (
    gather_kv_pages,
    kernel_cache,
    put_kernel_cache,
    read_mamba_state,
    read_view,
    validate_block_ids,
    validate_slot_mapping,
    write_kv,
    write_mamba_state,
    zero_blocks,
)
from jaxkv.cache.plan import (
    KVCacheBudget,
    KVCachePlan,
    LayerStack,
    kv_cache_budget,
    make_plan,
)
from jaxkv.cache.planner import (
    HybridBlockAlignment,
    align_hybrid_block_size,
    make_kv_cache_config,
    unify_page_sizes,
)
from jaxkv.cache.pools import (
    KVCacheInit,
    PoolLayout,
    PoolSpec,
    allocate_pools,
    init_kv_cache,
    plan_kv_cache,
    resolve_storage,
)
from jaxkv.cache.shard import (
    ShardedPlan,
    local_kv_heads,
    local_runner_config,
    shard_plan,
)
from jaxkv.cache.views import KVCacheView, LayerView, MambaView
from jaxkv.cache.vllm_layout import (
    LayerTensor,
    TensorLayout,
    allocate_layer_tensors,
    hnc_shape,
    layout_of_view,
    layout_strides,
    plan_tensors,
    resolve_layout,
    tensor_views,
)
from jaxkv.config import LayerConfig, RunnerConfig
from jaxkv.examples import llama_like_config, tiny_hybrid_config
from jaxkv.groups.attn_group import AttentionGroup
from jaxkv.groups.cg_support import (
    AttentionCGSupportInfo,
    get_attn_cg_support,
    get_query_lens_mismatch_unsupported_backend,
    get_varlen_cudagraph_unsupported_backend,
)
from jaxkv.groups.init_backend import (
    AttnBackendInit,
    init_attn_backend,
    with_kv_sharing_layers,
)
from jaxkv.groups.kernel_blocks import (
    expand_block_table,
    kernel_block_sizes_by_group,
    map_slot_mapping_to_kernel,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from jaxkv.kv_cache_config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    add_kv_sharing_layers_to_kv_cache_groups,
)
from jaxkv.layers import (
    get_kv_cache_spec,
    get_kv_sharing_fast_prefill_eligible_layers,
    get_shared_kv_cache_layers,
)
from jaxkv.mm import MultiModalFeatureSpec, PlaceholderRange, compute_mm_prefix_ranges
from jaxkv.monitoring import count_compilations
from jaxkv.pattern import parse_pattern, pattern_config
from jaxkv.sched.manager import KVCacheManager, StepBlocks, prefix_caching_unsupported
from jaxkv.sched.prefix import hash_token_blocks, longest_cache_hit
from jaxkv.sched.request import Request, RequestStatus
from jaxkv.sched.scheduler import (
    ScheduledStep,
    Scheduler,
    StepArrays,
    sampled_token_indices,
)
from jaxkv.serve.loop import Forward, ServingLoop
from jaxkv.serve.sampling import (
    SamplingParams,
    request_seed,
    sample_tokens,
    sample_tokens_per_row,
)
from jaxkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RawPageSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from jaxkv.step.buckets import (
    BatchDescriptor,
    BucketDispatcher,
    CompileMode,
    shape_struct,
    smallest_bucket,
)
from jaxkv.step.build import build_attn_metadata, build_attn_metadata_from_step
from jaxkv.step.builder import PreparedStep, StepInputs, StepMetadataBuilder
from jaxkv.step.fast_prefill import (
    FastPrefillBatchMetadata,
    FastPrefillHelper,
    make_kv_sharing_fast_prefill_common_attn_metadata,
    stage_logits_indices,
    validate_logits_indices,
    validate_query_start_loc,
)
from jaxkv.step.metadata import CommonAttentionMetadata
from jaxkv.step.packing import StepLayout, pack_step, unpack_step
from jaxkv.step.programs import Programs
from jaxkv.step.validate import validate_step

try:
    __version__ = importlib.metadata.version("jaxkv")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
    __version__ = "0.0.0+source"

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionCGSupportInfo",
    "AttentionGroup",
    "AttentionLayer",
    "AttentionSpec",
    "AttnBackendInit",
    "BatchDescriptor",
    "BlockAllocator",
    "BoundKVCaches",
    "BucketDispatcher",
    "ChunkedLocalAttentionSpec",
    "CommonAttentionMetadata",
    "CompileMode",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FastPrefillBatchMetadata",
    "FastPrefillHelper",
    "Forward",
    "FullAttentionSpec",
    "HybridBlockAlignment",
    "KVCacheBudget",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheInit",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCachePlan",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVCacheView",
    "LayerConfig",
    "LayerStack",
    "LayerTensor",
    "LayerView",
    "MLAAttentionSpec",
    "MambaSpec",
    "MambaView",
    "MultiModalFeatureSpec",
    "MultipleOf",
    "PlaceholderRange",
    "PoolLayout",
    "PoolSpec",
    "PreparedStep",
    "Programs",
    "RawPageSpec",
    "Request",
    "RequestStatus",
    "RunnerConfig",
    "SamplingParams",
    "ScheduledStep",
    "Scheduler",
    "ServingLoop",
    "ShardedPlan",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StepArrays",
    "StepBlocks",
    "StepInputs",
    "StepLayout",
    "StepMetadataBuilder",
    "TensorLayout",
    "UniformTypeKVCacheSpecs",
    "_align_mixed_attention_kv_cache_views",
    "_kv_first_layers_sharing_pool_with_mamba",
    "add_kv_sharing_layers_to_kv_cache_groups",
    "align_hybrid_block_size",
    "allocate_layer_tensors",
    "allocate_pools",
    "bind_kv_caches",
    "build_attn_metadata",
    "build_attn_metadata_from_step",
    "build_kv_cache_views",
    "build_slot_mappings_by_layer",
    "compute_mm_prefix_ranges",
    "count_compilations",
    "create_fast_prefill_custom_backend",
    "expand_block_table",
    "gather_kv_pages",
    "get_attn_cg_support",
    "get_backend",
    "get_kv_cache_spec",
    "get_kv_sharing_fast_prefill_eligible_layers",
    "get_num_skipped_tokens",
    "get_query_lens_mismatch_unsupported_backend",
    "get_shared_kv_cache_layers",
    "get_varlen_cudagraph_unsupported_backend",
    "hash_token_blocks",
    "hnc_shape",
    "init_attn_backend",
    "init_kv_cache",
    "kernel_block_sizes_by_group",
    "kernel_cache",
    "kv_cache_budget",
    "layout_of_view",
    "layout_strides",
    "llama_like_config",
    "local_attention",
    "local_kv_heads",
    "local_runner_config",
    "longest_cache_hit",
    "make_kv_cache_config",
    "make_kv_sharing_fast_prefill_common_attn_metadata",
    "make_plan",
    "map_slot_mapping_to_kernel",
    "pack_step",
    "paged_attention",
    "parse_pattern",
    "pattern_config",
    "plan_kv_cache",
    "plan_tensors",
    "prefix_caching_unsupported",
    "prepare_kernel_block_sizes",
    "put_kernel_cache",
    "read_mamba_state",
    "read_view",
    "register_backend",
    "registered_backends",
    "request_seed",
    "request_token_rows",
    "resolve_layout",
    "resolve_storage",
    "sample_tokens",
    "sample_tokens_per_row",
    "sampled_token_indices",
    "select_common_block_size",
    "shape_struct",
    "shard_plan",
    "smallest_bucket",
    "stage_logits_indices",
    "tensor_views",
    "tiny_hybrid_config",
    "token_requests_and_positions",
    "unify_page_sizes",
    "unpack_step",
    "validate_block_ids",
    "validate_logits_indices",
    "validate_query_start_loc",
    "validate_slot_mapping",
    "validate_step",
    "with_kv_sharing_layers",
    "write_kv",
    "write_mamba_state",
    "zero_blocks",
]
