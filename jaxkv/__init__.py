"""jaxkv: paged KV-cache views, attention groups and step metadata for JAX.

This namespace is the plan-first API: describe the model
(:class:`RunnerConfig`, :func:`pattern_config`), plan its cache
(:func:`make_plan`), read and write it inside your jit (:func:`write_kv`,
:func:`paged_attention`, ...), schedule requests (:class:`Scheduler`), build
each step's metadata (:class:`StepMetadataBuilder`) and serve
(:class:`ServingLoop`). vLLM's own names for the same machinery, in vLLM's
argument order, are in :mod:`jaxkv.vllm` (the seeds' ``init_attn_backend``,
``bind_kv_caches``, ``build_attn_metadata``, ...). The rest of each layer's
API lives in its sub-package: :mod:`jaxkv.plan` (host-side, static),
:mod:`jaxkv.kv` (inside jit), :mod:`jaxkv.attention`, :mod:`jaxkv.groups`,
:mod:`jaxkv.sched`, :mod:`jaxkv.step`, :mod:`jaxkv.serve`,
:mod:`jaxkv.transfer`. ``jaxkv`` itself has exactly the names of its
``__all__``. docs/architecture.md draws the layers.

The core imports jax, numpy and jaxtyping only; the demo model and Engine
live in :mod:`jaxkv.demo` (the ``demo`` extra, Flax), which ``import jaxkv``
does not load.
"""

import importlib.metadata as _metadata

# The sub-packages, as jaxkv.<name> (jaxkv.pictures needs matplotlib: not here).
from jaxkv import (
    attention,
    config,
    groups,
    kv,
    plan,
    sched,
    serve,
    step,
    transfer,
    vllm,
)
from jaxkv._examples import llama_like_config, tiny_hybrid_config
from jaxkv._pattern import parse_pattern, pattern_config
from jaxkv.attention import (
    paged_attention,
    request_token_rows,
    token_requests_and_positions,
)
from jaxkv.config import (
    AttentionBackend,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheSpec,
    LayerConfig,
    MambaSpec,
    MLAAttentionSpec,
    RawPageSpec,
    RunnerConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_backend,
    register_backend,
    registered_backends,
)
from jaxkv.kv import (
    copy_blocks,
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
from jaxkv.plan import (
    KVCacheBudget,
    KVCachePlan,
    KVCacheView,
    LayerStack,
    MambaView,
    ShardedPlan,
    kv_cache_budget,
    make_plan,
    shard_plan,
    size_kv_cache,
)
from jaxkv.sched import KVCacheManager, Request, RequestStatus, ScheduledStep, Scheduler
from jaxkv.serve import (
    ExecutionOptions,
    Forward,
    SamplingParams,
    SchedulingOptions,
    ServingLoop,
    sample_tokens,
    sample_tokens_per_row,
)
from jaxkv.step import (
    BucketDispatcher,
    CommonAttentionMetadata,
    Programs,
    StepArrays,
    StepInputs,
    StepMetadataBuilder,
    count_compilations,
    validate_step,
)

try:
    __version__ = _metadata.version("jaxkv")
except _metadata.PackageNotFoundError:  # a source tree on sys.path
    __version__ = "0.0.0+source"

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "BucketDispatcher",
    "ChunkedLocalAttentionSpec",
    "CommonAttentionMetadata",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "ExecutionOptions",
    "Forward",
    "FullAttentionSpec",
    "KVCacheBudget",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCachePlan",
    "KVCacheSpec",
    "KVCacheView",
    "LayerConfig",
    "LayerStack",
    "MLAAttentionSpec",
    "MambaSpec",
    "MambaView",
    "Programs",
    "RawPageSpec",
    "Request",
    "RequestStatus",
    "RunnerConfig",
    "SamplingParams",
    "ScheduledStep",
    "Scheduler",
    "SchedulingOptions",
    "ServingLoop",
    "ShardedPlan",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StepArrays",
    "StepInputs",
    "StepMetadataBuilder",
    "UniformTypeKVCacheSpecs",
    "attention",
    "config",
    "copy_blocks",
    "count_compilations",
    "gather_kv_pages",
    "get_backend",
    "groups",
    "kernel_cache",
    "kv",
    "kv_cache_budget",
    "llama_like_config",
    "make_plan",
    "paged_attention",
    "parse_pattern",
    "pattern_config",
    "plan",
    "put_kernel_cache",
    "read_mamba_state",
    "read_view",
    "register_backend",
    "registered_backends",
    "request_token_rows",
    "sample_tokens",
    "sample_tokens_per_row",
    "sched",
    "serve",
    "shard_plan",
    "size_kv_cache",
    "step",
    "tiny_hybrid_config",
    "token_requests_and_positions",
    "transfer",
    "validate_block_ids",
    "validate_slot_mapping",
    "validate_step",
    "vllm",
    "write_kv",
    "write_mamba_state",
    "zero_blocks",
]
