"""jaxkv: paged KV-cache views, attention groups and step metadata for JAX serving."""

import importlib.metadata

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
from jaxkv._cg_support import (
    AttentionCGSupportInfo,
    get_attn_cg_support,
    get_query_lens_mismatch_unsupported_backend,
    get_varlen_cudagraph_unsupported_backend,
)
from jaxkv._config import LayerConfig, RunnerConfig
from jaxkv._init_backend import init_attn_backend, with_kv_sharing_layers
from jaxkv._kernel_blocks import (
    expand_block_table,
    map_slot_mapping_to_kernel,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from jaxkv._kv_cache_config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    add_kv_sharing_layers_to_kv_cache_groups,
)
from jaxkv._layers import (
    get_kv_cache_spec,
    get_kv_sharing_fast_prefill_eligible_layers,
    get_shared_kv_cache_layers,
)
from jaxkv._planner import make_kv_cache_config, tiny_hybrid_config
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

__version__ = importlib.metadata.version("jaxkv")

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionCGSupportInfo",
    "AttentionGroup",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCacheTensor",
    "LayerConfig",
    "MLAAttentionSpec",
    "MambaSpec",
    "MultipleOf",
    "RunnerConfig",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "add_kv_sharing_layers_to_kv_cache_groups",
    "create_fast_prefill_custom_backend",
    "expand_block_table",
    "get_attn_cg_support",
    "get_backend",
    "get_kv_cache_spec",
    "get_kv_sharing_fast_prefill_eligible_layers",
    "get_query_lens_mismatch_unsupported_backend",
    "get_shared_kv_cache_layers",
    "get_varlen_cudagraph_unsupported_backend",
    "init_attn_backend",
    "make_kv_cache_config",
    "map_slot_mapping_to_kernel",
    "prepare_kernel_block_sizes",
    "register_backend",
    "registered_backends",
    "select_common_block_size",
    "tiny_hybrid_config",
    "with_kv_sharing_layers",
]
