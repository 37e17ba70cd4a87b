"""The registry of attention backends by key: vLLM's built-in ones and yours.

The registry of attention backends by key: the built-in ones (vLLM's names and
capability flags) and those you register.
"""

from __future__ import annotations

from jaxkv.config._backends import (
    AttentionBackend,
    AttentionCGSupport,
    KVCacheLayout,
    MultipleOf,
)

_ALWAYS = AttentionCGSupport.ALWAYS

_REGISTRY: dict[str, AttentionBackend] = {
    "FLASH_ATTN": AttentionBackend(
        name="FlashAttentionBackend",
        layout=KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(MultipleOf(16),),
        supports_batch_invariance=True,
        supports_update_block_table=True,
    ),
    "TRITON_ATTN": AttentionBackend(
        name="TritonAttentionBackend",
        layout=KVCacheLayout.BLOCKS_FIRST,
        supported_kernel_block_sizes=(MultipleOf(16),),
        supports_batch_invariance=True,
    ),
    "FLASHINFER": AttentionBackend(
        name="FlashInferBackend",
        layout=KVCacheLayout.BLOCKS_FIRST,
        stride_order=(0, 1, 3, 2, 4),  # HND
        supported_kernel_block_sizes=(16, 32, 64),
        cudagraph_support=AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
    ),
    "ROCM_ATTN": AttentionBackend(
        name="RocmAttentionBackend",
        layout=KVCacheLayout.KV_FIRST,
        supported_kernel_block_sizes=(MultipleOf(16),),
    ),
    "FLASHMLA": AttentionBackend(
        name="FlashMLABackend",
        layout=KVCacheLayout.MLA,
        supported_kernel_block_sizes=(64,),
        cudagraph_support=AttentionCGSupport.UNIFORM_BATCH,
    ),
    "MAMBA2": AttentionBackend(
        name="Mamba2AttentionBackend",
        layout=KVCacheLayout.MAMBA,
        cudagraph_support=AttentionCGSupport.UNIFORM_BATCH,
        varlen_cudagraph_max_query_len=1,
        supports_update_block_table=True,
    ),
    "JAX_PAGED": AttentionBackend(
        name="JaxPagedAttentionBackend",
        layout=KVCacheLayout.BLOCKS_FIRST,
        supports_batch_invariance=True,
        supports_update_block_table=True,
    ),
    "JAX_PAGED_FUSED": AttentionBackend(
        name="JaxPagedFusedAttentionBackend",
        layout=KVCacheLayout.BLOCKS_FIRST_FUSED,
        supports_batch_invariance=True,
        supports_update_block_table=True,
    ),
    "RPA_V3": AttentionBackend(
        name="RaggedPagedAttentionV3Backend",
        layout=KVCacheLayout.BLOCKS_FIRST_FUSED,
        supports_batch_invariance=True,
        supports_update_block_table=True,
        packs_kv_heads=True,
    ),
    "JAX_PAGED_KV_FIRST": AttentionBackend(
        name="JaxPagedKVFirstAttentionBackend",
        layout=KVCacheLayout.KV_FIRST,
        supports_batch_invariance=True,
    ),
}


def register_backend(key: str, backend: AttentionBackend) -> AttentionBackend:
    """Adds `backend` to the registry under `key`.

    Args:
      key: Registry key (``"FLASH_ATTN"`` style).
      backend: The capability record.

    Returns:
      `backend`, so the call can be used as an expression.

    Raises:
      ValueError: If `key` is taken by a different backend.

    Example:
      >>> import jaxkv
      >>> mine = jaxkv.AttentionBackend(name="MyBackend",
      ...     layout=jaxkv.KVCacheLayout.BLOCKS_FIRST)
      >>> jaxkv.register_backend("MY_BACKEND", mine) is jaxkv.get_backend("MY_BACKEND")
      True
    """
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"backend must be an AttentionBackend, got {backend!r}.")
    existing = _REGISTRY.get(key)
    if existing is not None and existing != backend:
        raise ValueError(f"Backend key {key!r} is already registered as {existing}.")
    _REGISTRY[key] = backend
    return backend


def get_backend(key: str | AttentionBackend) -> AttentionBackend:
    """Looks up a registered backend (a backend given is returned as is).

    Raises:
      KeyError: Naming the known keys.

    Example:
      >>> import jaxkv
      >>> jaxkv.get_backend("ROCM_ATTN").layout
      <KVCacheLayout.KV_FIRST: 'kv_first'>
    """
    if isinstance(key, AttentionBackend):
        return key
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(
            f"Unknown backend {key!r}; registered: {sorted(_REGISTRY)}."
        ) from None


def registered_backends() -> dict[str, AttentionBackend]:
    """A copy of the registry (key -> backend).

    Example:
      >>> import jaxkv
      >>> "FLASHINFER" in jaxkv.registered_backends()
      True
    """
    return dict(_REGISTRY)
