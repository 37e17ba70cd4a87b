"""Per-layer views of the pools: the bytes of each layer's blocks (§1.4, §2.11-§2.13).

Pure Python over static data: every rule here maps a layer's spec, backend,
kernel block size and pool to a :class:`KVCacheView` (or :class:`MambaView`);
nothing is allocated or compiled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxkv._util import check_non_negative_int, check_positive_int
from jaxkv.config import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    RunnerConfig,
    get_shared_kv_cache_layers,
    layer_spec,
    representative_spec,
)
from jaxkv.groups import (
    AttentionGroup,
    flat_groups,
    kernel_block_sizes_by_group,
    with_kv_sharing_layers,
)
from jaxkv.plan._mixed_layouts import (
    _align_mixed_attention_kv_cache_views,
    _kv_first_layers_sharing_pool_with_mamba,
)
from jaxkv.plan._views import KVCacheView, LayerView, MambaView, attention_view


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
        return _mamba_view(name, spec, pool, num_blocks, block_stride, offset)
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"Layer {name!r}: {type(spec).__name__} has no view rule.")
    if spec.is_packed:
        return packed_view(
            name,
            spec,
            pool=pool,
            num_blocks=num_blocks,
            block_stride=block_stride,
            offset=offset,
            kernel_block_size=k,
        )
    r = spec.block_size // k
    unpadded = spec.real_page_size_bytes
    block_dim = group.backend.get_kv_cache_block_dim(
        k, spec.num_kv_heads, spec.head_size, cache_dtype
    )
    dense_kv_first = block_dim != 0 and not page_aligned and not tensor.is_packed
    if spec.quant_scale_bytes and (dense_kv_first or r > 1):
        raise ValueError(
            f"Layer {name!r}: {spec.kv_quant_mode} pages keep their scales at the "
            "end of each page, which a "
            f"{'K/V-first' if dense_kv_first else 'kernel-split'} view cannot "
            "address; use a blocks-first layout with kernel blocks of the whole "
            "block."
        )
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
        kv_quant_mode=spec.kv_quant_mode,
        block_stride=None if dense_kv_first else block_stride // r,
        offset=offset,
    )


def packed_view(
    name: str,
    spec: AttentionSpec,
    *,
    pool: int,
    num_blocks: int,
    block_stride: int,
    offset: int,
    kernel_block_size: int,
) -> KVCacheView:
    """A packed attention layer's view: vLLM's ``[B, N, H, C]`` page, typed.

    For specs with vLLM's packing fields (:attr:`AttentionSpec.is_packed`):
    ``(blocks, states, head slots, C / itemsize)``, axes ``block, state,
    head, dim`` (MLA: no slot axis), states outer, slots inner, content
    innermost, as one slot per token is stored. Kernel blocks smaller than
    the manager block split a dense page into ``block_size / k`` blocks of
    ``k / tokens_per_state`` states.

    Raises:
      TypeError: If a count, offset or stride is not an int.
      ValueError: If a count or the kernel block is not positive, the pool
        or offset negative, a block stride shorter than a page (pages would
        overlap), a kernel block holds no whole number of states, a split
        page is padded, or a stride is not a multiple of the itemsize.

    Example (a DeepSeek-style compressed indexer: 4 tokens a state):
      >>> import jaxkv
      >>> spec = jaxkv.MLAAttentionSpec(block_size=64, num_kv_heads=1,
      ...     head_size=68, dtype="uint8", state_content_bytes=68, tokens_per_state=4)
      >>> v = jaxkv.plan.packed_view("idx", spec, pool=0, num_blocks=3,
      ...     block_stride=spec.page_size_bytes, offset=0, kernel_block_size=64)
      >>> v.shape, v.strides, v.axes
      ((3, 16, 68), (1088, 68, 1), ('block', 'state', 'dim'))
    """
    owner = f"packed_view({name!r})"
    check_positive_int(owner, "kernel_block_size", kernel_block_size)
    check_positive_int(owner, "num_blocks", num_blocks)
    check_non_negative_int(owner, "pool", pool)
    check_non_negative_int(owner, "offset", offset)
    check_positive_int(owner, "block_stride", block_stride)
    if block_stride < spec.real_page_size_bytes:
        raise ValueError(
            f"{owner}.block_stride={block_stride} is shorter than a page of "
            f"{spec.real_page_size_bytes} bytes: pages would overlap."
        )
    k = spec.view_block_size(kernel_block_size)
    states = spec.states_in(k)
    if states is None:
        raise ValueError(
            f"Layer {name!r}: kernel block size {k} must divide block_size="
            f"{spec.block_size} into blocks of whole states (tokens_per_state="
            f"{spec.tokens_per_state})."
        )
    r = spec.block_size // k
    if r > 1 and block_stride != spec.real_page_size_bytes:
        raise ValueError(
            f"Layer {name!r}: splitting a block into {r} kernel blocks needs "
            f"dense, unpadded pages ({block_stride} bytes between blocks for a "
            f"page of {spec.real_page_size_bytes})."
        )
    itemsize = spec.itemsize
    content = spec.state_content_size_bytes // itemsize
    heads = spec.num_heads
    if (block_stride // r) % itemsize or offset % itemsize:
        raise ValueError(
            f"Layer {name!r}: its block stride ({block_stride // r} bytes) and "
            f"offset ({offset} bytes) must be multiples of the "
            f"{np.dtype(spec.dtype).name} itemsize ({itemsize})."
        )
    block = block_stride // r // itemsize
    if isinstance(spec, MLAAttentionSpec) and spec.num_head_slots is None:
        shape, strides = (num_blocks * r, states, content), (block, content, 1)
        axes: tuple[str, ...] = ("block", "state", "dim")
    else:
        shape = (num_blocks * r, states, heads, content)
        strides = (block, heads * content, content, 1)
        axes = ("block", "state", "head", "dim")
    return KVCacheView(
        pool=pool,
        offset=offset,
        shape=shape,
        strides=strides,
        dtype=spec.dtype,
        axes=axes,
    )


def _mamba_view(
    name: str,
    spec: MambaSpec,
    pool: int,
    num_blocks: int,
    block_stride: int,
    offset: int,
) -> MambaView:
    """A Mamba layer's view: one strided view per state array, a page per block."""
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
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> views = jaxkv.plan.build_kv_cache_views(kv, cfg, sizes, groups)
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
