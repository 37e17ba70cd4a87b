"""What a KV-cache config holds: per-request memory and concurrency.

What a KV-cache config holds: the memory one request may need per group, and
the requests of ``max_model_len`` tokens a config serves at once.
"""

from __future__ import annotations

from jaxkv._util import cdiv, check_positive_int
from jaxkv.config import (
    ChunkedLocalAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


def max_memory_usage_bytes(
    spec: KVCacheSpec, *, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """The most bytes one request can hold in a layer of `spec`.

    VLLM's ``KVCacheSpec.max_memory_usage_bytes``, one batch in flight.

    Full attention holds ``cdiv(max_model_len, block_size)`` pages; a sliding
    window ``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len),
    block_size) + 1`` (the window need not start at a block boundary); a
    chunked layer ``cdiv(min(chunk + max_num_batched_tokens, max_model_len),
    block_size)``; a Mamba layer one page; encoder-only layers none. A
    :class:`UniformTypeKVCacheSpecs` holds the most pages of any of its layers
    in every layer.

    Example (Qwen1.5-7B's layer, ``max_model_len=16384``):
      >>> import jaxkv
      >>> kw = dict(block_size=16, num_kv_heads=32, head_size=128, dtype="float16")
      >>> swa = jaxkv.SlidingWindowSpec(sliding_window=1024, **kw)
      >>> usage = jaxkv.vllm.max_memory_usage_bytes(
      ...     swa, max_model_len=16384, max_num_batched_tokens=1024)
      >>> usage // swa.page_size_bytes
      129
    """
    check_positive_int("max_memory_usage_bytes", "max_model_len", max_model_len)
    check_positive_int(
        "max_memory_usage_bytes", "max_num_batched_tokens", max_num_batched_tokens
    )
    if isinstance(spec, UniformTypeKVCacheSpecs):
        pages = max(
            cdiv(
                max_memory_usage_bytes(
                    s,
                    max_model_len=max_model_len,
                    max_num_batched_tokens=max_num_batched_tokens,
                ),
                s.page_size_bytes,
            )
            for s in spec.kv_cache_specs.values()
        )
        return pages * spec.page_size_bytes
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return 0
    if isinstance(spec, MambaSpec):
        return spec.page_size_bytes
    if isinstance(spec, SlidingWindowSpec):
        tokens = min(spec.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return (cdiv(tokens, spec.block_size) + 1) * spec.page_size_bytes
    if isinstance(spec, ChunkedLocalAttentionSpec):
        tokens = min(spec.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, spec.block_size) * spec.page_size_bytes
    return cdiv(max_model_len, spec.block_size) * spec.page_size_bytes


def get_max_concurrency_for_kv_cache_config(
    kv_cache_config: KVCacheConfig, *, max_model_len: int, max_num_batched_tokens: int
) -> float:
    """How many requests of `max_model_len` tokens `kv_cache_config` holds at once.

    vLLM's function of the same name: a request takes whole blocks from each
    group, ``cdiv(max_memory_usage_bytes, page)`` of them, and every group
    draws its block ids from the one pool of ``num_blocks``; the concurrency
    is ``num_blocks`` over the sum. An attention-free config has no limit
    (``inf``).

    Example (vLLM's worked numbers: full attention at 16384 tokens needs 1024
    blocks of 16):
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=32,
      ...     head_size=128, dtype="float16")
      >>> cfg = jaxkv.vllm.KVCacheConfig(num_blocks=1536, kv_cache_tensors=(),
      ...     kv_cache_groups=(jaxkv.vllm.KVCacheGroupSpec(
      ...         layer_names=("l0",), kv_cache_spec=spec),))
      >>> jaxkv.vllm.get_max_concurrency_for_kv_cache_config(
      ...     cfg, max_model_len=16384, max_num_batched_tokens=1024)
      1.5
    """
    blocks = sum(
        cdiv(
            max_memory_usage_bytes(
                g.kv_cache_spec,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
            ),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in kv_cache_config.kv_cache_groups
    )
    if blocks == 0:
        return float("inf")
    return kv_cache_config.num_blocks / blocks
