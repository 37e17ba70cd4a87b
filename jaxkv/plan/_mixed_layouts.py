"""Mixed layouts: K/V-first layers beside Mamba state, and view alignment.

Mixed layouts: which K/V-first layers share a pool with Mamba state (their
views must keep page alignment), and vLLM's alignment of mixed attention views
(§2.12-§2.13).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from jaxkv.config import AttentionSpec, KVCacheConfig, MambaSpec
from jaxkv.groups import AttentionGroup, flat_groups, kernel_block_sizes_by_group
from jaxkv.plan._views import KVCacheView, LayerView, restride_blocks_first_to_kv_first


def _block_dim(group: AttentionGroup, k: int, cache_dtype: str) -> int:
    spec = group.kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"Group {list(group.layer_names)} has no attention spec.")
    return group.backend.get_kv_cache_block_dim(
        k, spec.num_kv_heads, spec.head_size, cache_dtype_str=cache_dtype
    )


def _kv_first_layers_sharing_pool_with_mamba(
    attn_groups: Sequence[AttentionGroup] | Sequence[Sequence[AttentionGroup]],
    kernel_block_sizes: Sequence[int],
    cache_dtype: str,
    kv_cache_config: KVCacheConfig | None,
) -> set[str]:
    """K/V-first attention layers that share an allocation with Mamba state.

    Mamba addresses its state by page, so these layers have to lay their blocks
    out page by page as well; otherwise block ids from the two groups resolve
    to overlapping bytes (spec §2.12).

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config(attention_backend="ROCM_ATTN")
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> sorted(jaxkv.vllm._kv_first_layers_sharing_pool_with_mamba(groups, sizes, "auto", kv))
      ['layers.0.self_attn', 'layers.1.self_attn', 'layers.3.self_attn', 'layers.4.self_attn']
    """  # noqa: E501
    if kv_cache_config is None:
        return set()
    size_of = kernel_block_sizes_by_group(kv_cache_config, kernel_block_sizes)
    kv_first: set[str] = set()
    mamba: set[str] = set()
    for group in flat_groups(attn_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            mamba.update(group.layer_names)
            continue
        if not isinstance(spec, AttentionSpec):
            continue
        k = size_of.get(group.kv_cache_group_id)
        if k is None:
            continue
        if _block_dim(group, k, cache_dtype) != 0:
            kv_first.update(group.layer_names)
    page_aligned: set[str] = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        if mamba.isdisjoint(tensor.shared_by):
            continue
        page_aligned.update(kv_first.intersection(tensor.shared_by))
    return page_aligned


def _align_mixed_attention_kv_cache_views(
    attn_groups: Iterable[AttentionGroup] | Iterable[Sequence[AttentionGroup]],
    kv_caches: Mapping[str, LayerView],
    kernel_block_sizes: Sequence[int],
    cache_dtype: str,
    kv_cache_config: KVCacheConfig,
    page_aligned_layers: set[str],
) -> dict[str, LayerView]:
    """Align shared attention KV views when backends disagree on layout.

    Encoder-decoder models can share one pool between decoder self-attention
    (K/V-first, block dim 1) and cross-attention (blocks-first, block dim 0).
    Storage stays K/V-first; the blocks-first views are restrided (V4) so block
    ids address the same bytes. Returns the updated mapping (jaxkv never
    mutates its input).

    Raises:
      ValueError: If a blocks-first partner has no explicit K/V axis.

    Example (spec §2.13: N=4, B=16, H=1, D=2, fp32; self-attention K/V-first,
    cross-attention blocks-first, one pool):
      >>> import jaxkv
      >>> kw = dict(block_size=16, num_kv_heads=1, head_size=2, dtype="float32")
      >>> cfg = jaxkv.RunnerConfig(layers=[
      ...     jaxkv.LayerConfig(name="self", spec=jaxkv.FullAttentionSpec(**kw),
      ...                       backend=jaxkv.get_backend("ROCM_ATTN")),
      ...     jaxkv.LayerConfig(name="cross", spec=jaxkv.CrossAttentionSpec(**kw),
      ...                       backend=jaxkv.get_backend("FLASH_ATTN"),
      ...                       attn_type="encoder_decoder")])
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> views = jaxkv.plan.build_kv_cache_views(kv, cfg, sizes, groups)
      >>> views["cross"].strides  # restrided from (64, 32, 2, 2, 1)
      (32, 128, 2, 2, 1)
    """
    size_of = kernel_block_sizes_by_group(kv_cache_config, kernel_block_sizes)
    block_dims: dict[str, int] = {}
    for group in flat_groups(attn_groups):
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            continue
        k = size_of.get(group.kv_cache_group_id)
        if k is None:
            continue
        bd = _block_dim(group, k, cache_dtype)
        for name in group.layer_names:
            if name in kv_caches:
                block_dims[name] = bd
    out = dict(kv_caches)
    for tensor in kv_cache_config.kv_cache_tensors:
        if tensor.block_stride > 0:
            continue
        if not page_aligned_layers.isdisjoint(tensor.shared_by):
            # Page-aligned K/V-first views already address blocks by page, like
            # blocks-first views: restriding onto K/V-first storage would be wrong.
            continue
        dims = {block_dims[n] for n in tensor.shared_by if n in block_dims}
        if 0 not in dims or 1 not in dims:
            continue
        for name in tensor.shared_by:
            if block_dims.get(name) == 0:
                view = out[name]
                if not isinstance(view, KVCacheView):
                    raise TypeError(
                        f"Layer {name!r} has no attention view to restride."
                    )
                out[name] = restride_blocks_first_to_kv_first(view)
    return out
