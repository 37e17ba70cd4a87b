"""Shared test helpers: compile counters and small model configs."""

from __future__ import annotations

import os

import jaxkv


def examples(n: int) -> int:
    """Hypothesis example count: `n`, or a twentieth of it when JAXKV_QUICK=1."""
    return max(5, n // 20) if os.environ.get("JAXKV_QUICK") == "1" else n


count_compiles = jaxkv.count_compilations


def full_spec(block_size: int = 16, heads: int = 8, head: int = 128, dtype="bfloat16"):
    return jaxkv.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype
    )


def layer(name, spec, backend="FLASH_ATTN", **kw):
    return jaxkv.LayerConfig(
        name=name, spec=spec, backend=jaxkv.get_backend(backend), **kw
    )


def single_group_config(names, spec, num_blocks=4):
    return jaxkv.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            jaxkv.KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n])
            for n in names
        ],
        kv_cache_groups=[jaxkv.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)],
    )
