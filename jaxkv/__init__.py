"""jaxkv: paged KV-cache views, attention groups and step metadata for JAX serving.

This namespace is the plan-first API: describe the model
(:class:`RunnerConfig`, :func:`pattern_config`), plan its cache
(:func:`make_plan`), read and write it inside your jit (:func:`write_kv`,
:func:`paged_attention`, ...), schedule requests (:class:`Scheduler`), build
each step's metadata (:class:`StepMetadataBuilder`) and serve
(:class:`ServingLoop`). vLLM's own names for the same machinery, in vLLM's
argument order, are in :mod:`jaxkv.vllm` (the seeds' ``init_attn_backend``,
``bind_kv_caches``, ``build_attn_metadata``, ...); they also resolve here, as
attributes outside ``__all__``, where a vLLM port's user looks for them. The
rest of each layer's API lives in its sub-package: :mod:`jaxkv.cache`,
:mod:`jaxkv.groups`, :mod:`jaxkv.sched`, :mod:`jaxkv.step`,
:mod:`jaxkv.serve`. ARCHITECTURE.md draws the layers.

The core imports jax, numpy and jaxtyping only; the demo model and Engine
live in :mod:`jaxkv.demo` (the ``demo`` extra, Flax), which ``import jaxkv``
does not load.
"""  # noqa: D205

import importlib
import importlib.metadata

from jaxkv import vllm as vllm  # the vLLM-named API, as jaxkv.vllm
from jaxkv._backend_registry import get_backend, register_backend, registered_backends
from jaxkv._backends import AttentionBackend, KVCacheLayout
from jaxkv._config import LayerConfig, RunnerConfig
from jaxkv._examples import llama_like_config, tiny_hybrid_config
from jaxkv._group_specs import RawPageSpec, UniformTypeKVCacheSpecs
from jaxkv._mamba_spec import MambaSpec
from jaxkv._monitoring import count_compilations
from jaxkv._pattern import parse_pattern, pattern_config
from jaxkv._specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from jaxkv.attention import (
    paged_attention,
    request_token_rows,
    token_requests_and_positions,
)
from jaxkv.cache import (
    KVCacheBudget,
    KVCachePlan,
    KVCacheView,
    LayerStack,
    MambaView,
    ShardedPlan,
    gather_kv_pages,
    kernel_cache,
    kv_cache_budget,
    make_plan,
    put_kernel_cache,
    read_mamba_state,
    read_view,
    shard_plan,
    validate_block_ids,
    validate_slot_mapping,
    write_kv,
    write_mamba_state,
    zero_blocks,
)
from jaxkv.sched import KVCacheManager, Request, RequestStatus, ScheduledStep, Scheduler
from jaxkv.serve import (
    Forward,
    SamplingParams,
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
    validate_step,
)

try:
    __version__ = importlib.metadata.version("jaxkv")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
    __version__ = "0.0.0+source"

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "BucketDispatcher",
    "ChunkedLocalAttentionSpec",
    "CommonAttentionMetadata",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
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
    "ServingLoop",
    "ShardedPlan",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StepArrays",
    "StepInputs",
    "StepMetadataBuilder",
    "UniformTypeKVCacheSpecs",
    "count_compilations",
    "gather_kv_pages",
    "get_backend",
    "kernel_cache",
    "kv_cache_budget",
    "llama_like_config",
    "make_plan",
    "paged_attention",
    "parse_pattern",
    "pattern_config",
    "put_kernel_cache",
    "read_mamba_state",
    "read_view",
    "register_backend",
    "registered_backends",
    "request_token_rows",
    "sample_tokens",
    "sample_tokens_per_row",
    "shard_plan",
    "tiny_hybrid_config",
    "token_requests_and_positions",
    "validate_block_ids",
    "validate_slot_mapping",
    "validate_step",
    "write_kv",
    "write_mamba_state",
    "zero_blocks",
]

_PUBLIC_MODULES = (
    "attention",
    "cache",
    "groups",
    "pictures",
    "sched",
    "serve",
    "step",
    "transfer",
    "vllm",
)
# Where a name outside __all__ resolves, in order: vLLM's names first (the
# seeds' API, where a vLLM port's user looks), then each layer's sub-package.
_ELSEWHERE = (
    "jaxkv.vllm",
    "jaxkv.attention",
    "jaxkv.cache",
    "jaxkv.groups",
    "jaxkv.sched",
    "jaxkv.step",
    "jaxkv.serve",
    "jaxkv.transfer",
)


def __getattr__(name: str):
    """Resolves vLLM's names and each sub-package's API on first use.

    ``jaxkv.init_attn_backend`` is :func:`jaxkv.vllm.init_attn_backend`;
    ``jaxkv.pack_step`` is :func:`jaxkv.step.pack_step`. The lookup is by
    name in each module's ``__all__``; nothing is copied or wrapped.
    """
    if name in _PUBLIC_MODULES:
        return importlib.import_module(f"jaxkv.{name}")
    for module_name in _ELSEWHERE:
        module = importlib.import_module(module_name)
        if name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_PUBLIC_MODULES) | {"__version__"})
