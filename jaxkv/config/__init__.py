"""config: what a model is before anything is planned: specs, backends, its config.

``_specs`` and ``_mamba_spec`` hold the KV-cache specs with vLLM's page
arithmetic, ``_group_specs`` a group's representative spec, ``_backends``
and ``_backend_registry`` the attention backends as static capability
records, ``_config`` the runner config that replaces ``VllmConfig``,
``_kv_cache_config`` vLLM's ``KVCacheConfig`` records and ``_layer_queries``
the questions asked of a config (a layer's spec, KV sharing, fast prefill).
"""

from jaxkv.config._backend_registry import (
    get_backend,
    register_backend,
    registered_backends,
)
from jaxkv.config._backends import (
    AttentionBackend,
    AttentionCGSupport,
    KVCacheLayout,
    MultipleOf,
    create_fast_prefill_custom_backend,
)
from jaxkv.config._config import (
    LayerConfig,
    RunnerConfig,
)
from jaxkv.config._group_specs import (
    RawPageSpec,
    UniformTypeKVCacheSpecs,
    layer_spec,
    representative_spec,
)
from jaxkv.config._kv_cache_config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    add_kv_sharing_layers_to_kv_cache_groups,
    packed_tensor_of_layers,
)
from jaxkv.config._layer_queries import (
    get_kv_cache_spec,
    get_kv_sharing_fast_prefill_eligible_layers,
    get_shared_kv_cache_layers,
)
from jaxkv.config._mamba_spec import (
    MambaSpec,
)
from jaxkv.config._specs import (
    KV_QUANT_MODES,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_num_skipped_tokens,
)

__all__ = [
    "AttentionBackend",
    "AttentionCGSupport",
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
    "KV_QUANT_MODES",
    "LayerConfig",
    "MLAAttentionSpec",
    "MambaSpec",
    "MultipleOf",
    "RawPageSpec",
    "RunnerConfig",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "add_kv_sharing_layers_to_kv_cache_groups",
    "create_fast_prefill_custom_backend",
    "get_backend",
    "get_kv_cache_spec",
    "get_kv_sharing_fast_prefill_eligible_layers",
    "get_num_skipped_tokens",
    "get_shared_kv_cache_layers",
    "layer_spec",
    "packed_tensor_of_layers",
    "register_backend",
    "registered_backends",
    "representative_spec",
]
