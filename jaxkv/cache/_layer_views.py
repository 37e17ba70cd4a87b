"""Per-layer views of the pools: the bytes of each layer's blocks (§1.4, §2.11-§2.13).

Pure Python over static data: every rule here maps a layer's spec, backend,
kernel block size and pool to a :class:`KVCacheView` (or :class:`MambaView`);
nothing is allocated or compiled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxkv._config import RunnerConfig
from jaxkv._group_specs import layer_spec, representative_spec
from jaxkv._kv_cache_config import KVCacheConfig, KVCacheTensor
from jaxkv._layer_queries import get_shared_kv_cache_layers
from jaxkv._mamba_spec import MambaSpec
from jaxkv._specs import AttentionSpec
from jaxkv.cache._views import (
    KVCacheView,
    LayerView,
    MambaView,
    attention_view,
    restride_blocks_first_to_kv_first,
)
from jaxkv.groups import (
    AttentionGroup,
    kernel_block_sizes_by_group,
    with_kv_sharing_layers,
)


def pool_index(kv_cache_config: KVCacheConfig) -> tuple[list[int], dict[int, int]]:
    """Pool sizes and ``tensor index -> pool index`` (all packed tensors: one pool)."""
    sizes: list[int] = []
    of_tensor: dict[int, int] = {}
    packed_pool: int | None = None
    for tid, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        if tensor.is_packed:
            if packed_pool is None:
                packed_pool = len(sizes)
                sizes.append(tensor.size)
            of_tensor[tid] = packed_pool
        else:
            of_tensor[tid] = len(sizes)
            sizes.append(tensor.size)
    return sizes, of_tensor


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
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
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
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> views = jaxkv.cache.build_kv_cache_views(kv, cfg, sizes, groups)
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


def flat_groups(groups: Iterable[Any]) -> list[AttentionGroup]:
    """Attention groups from a flat or a per-KV-cache-group nested sequence."""
    flat: list[AttentionGroup] = []
    for item in groups:
        if isinstance(item, AttentionGroup):
            flat.append(item)
        else:
            flat.extend(item)
    return flat


def _layer_view(
    name: str,
    group: AttentionGroup,
    k: int,
    tensor: KVCacheTensor,
    pool: int,
    page_aligned: bool,
    cache_dtype: str,
) -> LayerView:
    spec = group.kv_cache_spec
    page = spec.page_size_bytes
    if tensor.is_packed:
        if tensor.offset + page > tensor.block_stride:
            raise ValueError(
                f"Layer {name!r}: its page of {page} bytes at offset {tensor.offset} "
                f"does not fit in block_stride={tensor.block_stride}."
            )
        num_blocks, block_stride, offset = (
            tensor.size // tensor.block_stride,
            tensor.block_stride,
            tensor.offset,
        )
    else:
        if tensor.size % page:
            raise ValueError(
                f"Layer {name!r}: pool of {tensor.size} bytes is not a multiple of its "
                f"page of {page} bytes."
            )
        num_blocks, block_stride, offset = tensor.size // page, page, 0
    if isinstance(spec, MambaSpec):
        states = []
        for shape, dtype, state_offset in zip(
            spec.shapes, spec.dtypes, spec.state_offsets, strict=True
        ):
            itemsize = np.dtype(dtype).itemsize
            if block_stride % itemsize:
                raise ValueError(
                    f"Layer {name!r}: block stride {block_stride} is not a multiple of "
                    f"the {np.dtype(dtype).name} state itemsize."
                )
            inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
            states.append(
                KVCacheView(
                    pool=pool,
                    offset=offset + state_offset,
                    shape=(num_blocks, *shape),
                    strides=(block_stride // itemsize, *inner),
                    dtype=dtype,
                    axes=("block", *["state"] * len(shape)),
                )
            )
        return MambaView(states=tuple(states))
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"Layer {name!r}: {type(spec).__name__} has no view rule.")
    r = spec.block_size // k
    unpadded = spec.real_page_size_bytes
    block_dim = group.backend.get_kv_cache_block_dim(
        k, spec.num_kv_heads, spec.head_size, cache_dtype
    )
    dense_kv_first = block_dim != 0 and not page_aligned and not tensor.is_packed
    if dense_kv_first or r > 1:
        if page != unpadded or tensor.is_packed:
            raise ValueError(
                f"Layer {name!r}: a {'K/V-first' if dense_kv_first else 'kernel-split'}"
                f" view needs dense, unpadded pages, but its pool has "
                f"{'packed' if tensor.is_packed else 'padded'} pages ({page} bytes "
                f"reserved for {unpadded}); use a smaller block size or an unpadded, "
                "unpacked layout."
            )
    head_size_v = spec.head_size_v or 0
    return attention_view(
        group.backend,
        pool=pool,
        num_blocks=num_blocks * r,
        block_size=k,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=head_size_v if head_size_v else spec.head_size,
        dtype=np.dtype(spec.dtype),
        cache_dtype=cache_dtype,
        block_stride=None if dense_kv_first else block_stride // r,
        offset=offset,
    )


def _tensor_id(name: str, gid: int, tensor_index: Mapping[str, int]) -> int:
    """The KVCacheTensor holding layer `name` of KV-cache group `gid`.

    Raises:
      ValueError: If no tensor lists the layer in its ``shared_by``.
    """
    if name not in tensor_index:
        raise ValueError(
            f"Layer {name!r} of KV-cache group {gid} is in no KVCacheTensor's "
            "shared_by."
        )
    return tensor_index[name]


def _raw_page_views(
    kv_cache_config: KVCacheConfig,
    tensor_index: Mapping[str, int],
    pool_of_tensor: Mapping[int, int],
    shared: Mapping[str, str],
) -> dict[str, LayerView]:
    """Byte views ``(num_blocks, page)`` for layers of kinds without per-layer views.

    vLLM hands such layers their raw allocation; here each gets a ``uint8``
    view of its own pages (block ``b`` = bytes ``[offset + b*stride, + page)``).
    """
    out: dict[str, LayerView] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if representative_spec(spec).has_layer_views:
            continue
        for name in group.layer_names:
            if name in shared:
                continue
            tid = _tensor_id(name, gid, tensor_index)
            tensor = kv_cache_config.kv_cache_tensors[tid]
            page = layer_spec(spec, name).page_size_bytes
            stride = tensor.block_stride if tensor.is_packed else page
            out[name] = KVCacheView(
                pool=pool_of_tensor[tid],
                offset=tensor.offset if tensor.is_packed else 0,
                shape=(tensor.size // stride, page),
                strides=(stride, 1),
                dtype=np.uint8,
                axes=("block", "state"),
            )
    return out


def build_kv_cache_views(
    kv_cache_config: KVCacheConfig,
    runner_config: RunnerConfig,
    kernel_block_sizes: Sequence[int],
    attn_groups: Sequence[Sequence[AttentionGroup]],
) -> dict[str, LayerView]:
    """Per-layer views of the pools, before any word width is chosen.

    Views are created at the group-level kernel granularity; K/V-first layers
    sharing a pool with Mamba are page-aligned (V3); blocks-first partners of
    dense K/V-first layers are restrided (V4); KV-sharing layers alias their
    target's view (the same object). Pure Python: compiles nothing.

    Raises:
      ValueError: For a group layer in no pool, a pool that is not a whole number
        of pages, a split or K/V-first view of a padded or packed pool, or a
        mixed-layout repair without a K/V axis.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> views = jaxkv.cache.build_kv_cache_views(kv, cfg, sizes, groups)
      >>> views["layers.0.self_attn"].shape, views["layers.0.self_attn"].strides
      ((4, 2, 32, 2, 32), (4096, 2048, 64, 32, 1))
      >>> views["layers.6.self_attn"] is views["layers.3.self_attn"]
      True
    """
    kv_cache_config = with_kv_sharing_layers(kv_cache_config, runner_config)
    shared = get_shared_kv_cache_layers(runner_config)
    _, pool_of_tensor = pool_index(kv_cache_config)
    tensor_index = {
        name: tid
        for tid, t in enumerate(kv_cache_config.kv_cache_tensors)
        for name in t.shared_by
    }
    page_aligned = _kv_first_layers_sharing_pool_with_mamba(
        attn_groups, kernel_block_sizes, runner_config.cache_dtype, kv_cache_config
    )
    size_of = kernel_block_sizes_by_group(kv_cache_config, kernel_block_sizes)
    views: dict[str, LayerView] = {}
    for group in flat_groups(attn_groups):
        gid = group.kv_cache_group_id
        if gid not in size_of:
            continue
        for name in group.layer_names:
            if name in shared:
                continue
            tid = _tensor_id(name, gid, tensor_index)
            views[name] = _layer_view(
                name,
                group,
                size_of[gid],
                kv_cache_config.kv_cache_tensors[tid],
                pool_of_tensor[tid],
                name in page_aligned,
                runner_config.cache_dtype,
            )
    views.update(_raw_page_views(kv_cache_config, tensor_index, pool_of_tensor, shared))
    views = _align_mixed_attention_kv_cache_views(
        attn_groups,
        views,
        kernel_block_sizes,
        runner_config.cache_dtype,
        kv_cache_config,
        page_aligned,
    )
    for layer, target in shared.items():
        if target in views:
            views[layer] = views[target]
    return views
