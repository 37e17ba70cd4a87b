"""Planning a KV-cache config for a model, and the built-in example model config."""

from __future__ import annotations

from jaxkv._util import check_positive_int
from jaxkv.config import RunnerConfig
from jaxkv.kv_cache_config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from jaxkv.layers import get_kv_cache_spec
from jaxkv.specs import (
    EncoderOnlyAttentionSpec,
    KVCacheSpec,
)


def make_kv_cache_config(
    vllm_config: RunnerConfig, num_blocks: int, *, packed: bool = False
) -> KVCacheConfig:
    """Plans groups and pools the way vLLM's hybrid allocator does.

    Layers with equal specs form groups of ``n`` layers, ``n`` being the smallest
    number of layers of any spec; pool ``i`` is shared by the ``i``-th layer of
    every group, so a hybrid model has no memory per layer type, only per pool.
    With a single spec every layer gets its own pool in one group. Encoder-only
    layers get a group and no memory.

    Args:
      vllm_config: The runner configuration.
      num_blocks: Blocks per pool.
      packed: Pack the pools block-outermost into one backing (block ``b`` of
        pool ``i`` at ``b*block_stride + i*P``) instead of one array per pool.

    Returns:
      The KV-cache configuration (without KV-sharing layers; see
      :func:`with_kv_sharing_layers`).

    Raises:
      ValueError: If several specs have different page sizes (pad the smaller
        pages with ``page_size_padded``), or the model has no cache layer.

    Example:
      >>> import jaxkv
      >>> kv = jaxkv.make_kv_cache_config(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> [g.layer_names for g in kv.kv_cache_groups]
      [('layers.0.self_attn', 'layers.3.self_attn'), ('layers.1.self_attn', 'layers.4.self_attn'), ('layers.2.mixer', 'layers.5.mixer')]
      >>> [t.shared_by for t in kv.kv_cache_tensors]
      [('layers.0.self_attn', 'layers.1.self_attn', 'layers.2.mixer'), ('layers.3.self_attn', 'layers.4.self_attn', 'layers.5.mixer')]
    """  # noqa: E501
    check_positive_int("make_kv_cache_config", "num_blocks", num_blocks)
    by_spec: dict[KVCacheSpec, list[str]] = {}
    encoder_only: dict[KVCacheSpec, list[str]] = {}
    for name, spec in get_kv_cache_spec(vllm_config).items():
        target = encoder_only if isinstance(spec, EncoderOnlyAttentionSpec) else by_spec
        target.setdefault(spec, []).append(name)
    if not by_spec:
        raise ValueError(
            "make_kv_cache_config: the model has no layer with a KV cache."
        )
    pages = {spec.page_size_bytes for spec in by_spec}
    if len(pages) > 1:
        detail = ", ".join(
            f"{names[0]}: {s.page_size_bytes}" for s, names in by_spec.items()
        )
        raise ValueError(
            "make_kv_cache_config: hybrid layers must have equal page sizes, got "
            f"{detail}; set page_size_padded on the smaller pages."
        )
    page = pages.pop()
    if len(by_spec) == 1:
        ((spec, names),) = by_spec.items()
        groups = [(spec, names)]
        columns = [[name] for name in names]
    else:
        size = min(len(names) for names in by_spec.values())
        groups = [
            (spec, names[i : i + size])
            for spec, names in by_spec.items()
            for i in range(0, len(names), size)
        ]
        columns = [
            [names[i] for _, names in groups if i < len(names)] for i in range(size)
        ]
    if packed:
        stride = len(columns) * page
        tensors = [
            KVCacheTensor(
                size=num_blocks * stride,
                shared_by=tuple(c),
                offset=i * page,
                block_stride=stride,
            )
            for i, c in enumerate(columns)
        ]
    else:
        tensors = [
            KVCacheTensor(size=num_blocks * page, shared_by=tuple(c)) for c in columns
        ]
    group_specs = [
        KVCacheGroupSpec(layer_names=tuple(n), kv_cache_spec=s) for s, n in groups
    ]
    group_specs += [
        KVCacheGroupSpec(layer_names=tuple(n), kv_cache_spec=s)
        for s, n in encoder_only.items()
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tuple(tensors),
        kv_cache_groups=tuple(group_specs),
    )
