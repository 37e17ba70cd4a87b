"""jaxkv: paged KV-cache views, attention groups and step metadata for JAX serving."""

import importlib.metadata

from jaxkv._attention import paged_attention, token_requests_and_positions
from jaxkv._attn_group import AttentionGroup
from jaxkv._backend import (
    AttentionBackend,
    AttentionCGSupport,
    KVCacheLayout,
    MultipleOf,
    create_fast_prefill_custom_backend,
    get_backend,
    register_backend,
    registered_backends,
)
from jaxkv._bind import BoundKVCaches, bind_kv_caches, build_slot_mappings_by_layer
from jaxkv._buckets import (
    BatchDescriptor,
    BucketDispatcher,
    CompileMode,
    shape_struct,
    smallest_bucket,
)
from jaxkv._cg_support import (
    AttentionCGSupportInfo,
    get_attn_cg_support,
    get_query_lens_mismatch_unsupported_backend,
    get_varlen_cudagraph_unsupported_backend,
)
from jaxkv._config import LayerConfig, RunnerConfig
from jaxkv._fast_prefill import (
    FastPrefillBatchMetadata,
    FastPrefillHelper,
    stage_logits_indices,
    validate_logits_indices,
    validate_query_start_loc,
)
from jaxkv._init_backend import init_attn_backend, with_kv_sharing_layers
from jaxkv._kernel_blocks import (
    expand_block_table,
    map_slot_mapping_to_kernel,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from jaxkv._kv_cache import (
    PoolSpec,
    _align_mixed_attention_kv_cache_views,
    _kv_first_layers_sharing_pool_with_mamba,
    allocate_pools,
    build_kv_cache_views,
    init_kv_cache,
    plan_kv_cache,
)
from jaxkv._kv_cache_config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    add_kv_sharing_layers_to_kv_cache_groups,
)
from jaxkv._kv_ops import (
    gather_kv_pages,
    read_mamba_state,
    read_view,
    validate_block_ids,
    validate_slot_mapping,
    write_kv,
    write_mamba_state,
    zero_blocks,
)
from jaxkv._layers import (
    get_kv_cache_spec,
    get_kv_sharing_fast_prefill_eligible_layers,
    get_shared_kv_cache_layers,
)
from jaxkv._metadata import (
    CommonAttentionMetadata,
    StepLayout,
    build_attn_metadata,
    build_attn_metadata_from_step,
    make_kv_sharing_fast_prefill_common_attn_metadata,
    pack_step,
    unpack_step,
)
from jaxkv._mm import MultiModalFeatureSpec, PlaceholderRange, compute_mm_prefix_ranges
from jaxkv._model import TinyHybridModel, forward_dense, forward_paged
from jaxkv._monitoring import count_compilations
from jaxkv._planner import make_kv_cache_config, tiny_hybrid_config
from jaxkv._serve import (
    BlockAllocator,
    Engine,
    EngineStats,
    Request,
    generate_dense,
    get_num_skipped_tokens,
    progress_bar,
)
from jaxkv._specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from jaxkv._step import PreparedStep, StepMetadataBuilder
from jaxkv._views import KVCacheView, LayerView, MambaView

try:
    __version__ = importlib.metadata.version("jaxkv")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
    __version__ = "0.0.0+source"

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionCGSupportInfo",
    "AttentionGroup",
    "AttentionSpec",
    "BatchDescriptor",
    "BlockAllocator",
    "BoundKVCaches",
    "BucketDispatcher",
    "ChunkedLocalAttentionSpec",
    "CommonAttentionMetadata",
    "CompileMode",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "Engine",
    "EngineStats",
    "FastPrefillBatchMetadata",
    "FastPrefillHelper",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVCacheView",
    "LayerConfig",
    "LayerView",
    "MLAAttentionSpec",
    "MambaSpec",
    "MambaView",
    "MultiModalFeatureSpec",
    "MultipleOf",
    "PlaceholderRange",
    "PoolSpec",
    "PreparedStep",
    "Request",
    "RunnerConfig",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StepLayout",
    "StepMetadataBuilder",
    "TinyHybridModel",
    "UniformTypeKVCacheSpecs",
    "_align_mixed_attention_kv_cache_views",
    "_kv_first_layers_sharing_pool_with_mamba",
    "add_kv_sharing_layers_to_kv_cache_groups",
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
    "forward_dense",
    "forward_paged",
    "gather_kv_pages",
    "generate_dense",
    "get_attn_cg_support",
    "get_backend",
    "get_kv_cache_spec",
    "get_kv_sharing_fast_prefill_eligible_layers",
    "get_num_skipped_tokens",
    "get_query_lens_mismatch_unsupported_backend",
    "get_shared_kv_cache_layers",
    "get_varlen_cudagraph_unsupported_backend",
    "init_attn_backend",
    "init_kv_cache",
    "make_kv_cache_config",
    "make_kv_sharing_fast_prefill_common_attn_metadata",
    "map_slot_mapping_to_kernel",
    "pack_step",
    "paged_attention",
    "plan_kv_cache",
    "prepare_kernel_block_sizes",
    "progress_bar",
    "read_mamba_state",
    "read_view",
    "register_backend",
    "registered_backends",
    "select_common_block_size",
    "shape_struct",
    "smallest_bucket",
    "stage_logits_indices",
    "tiny_hybrid_config",
    "token_requests_and_positions",
    "unpack_step",
    "validate_block_ids",
    "validate_logits_indices",
    "validate_query_start_loc",
    "validate_slot_mapping",
    "with_kv_sharing_layers",
    "write_kv",
    "write_mamba_state",
    "zero_blocks",
]
