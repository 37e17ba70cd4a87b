"""Kernel-block views of packed pools, made at bind time (spec §1.8)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from jaxkv.config import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheTensor,
    RunnerConfig,
    get_shared_kv_cache_layers,
)
from jaxkv.groups import AttentionGroup, flat_groups, with_kv_sharing_layers
from jaxkv.plan._views import KVCacheView, LayerView


def kernel_view(
    view: KVCacheView, group: AttentionGroup, tensor: KVCacheTensor
) -> KVCacheView:
    """The §1.8 kernel-block view of a packed manager-block view.

    Kernel id ``q`` addresses ``[offset + q*U_k, offset + (q+1)*U_k)``; ids
    ``b*s + j`` (``j < r``) are manager block ``b``'s pieces.

    Raises:
      ValueError: If the group's slot mappings are not mapped to kernel space.
    """
    k = group.kernel_block_size
    if k is None or view.block_size == k:
        return view
    spec = group.kv_cache_spec
    if not isinstance(spec, AttentionSpec) or not tensor.is_packed:
        raise ValueError(
            f"Layers {list(group.layer_names)} need kernel blocks of {k} tokens but "
            f"their view has blocks of {view.block_size}; only packed attention pools "
            "are re-viewed at bind time."
        )
    if not group.maps_slot_mapping:
        raise ValueError(
            f"Layers {list(group.layer_names)} live in a packed pool and need kernel "
            f"blocks of {k} tokens, but their slot mappings are not mapped to kernel "
            "space; pass maps_slot_mapping=True or name them in slot_mapped_layers."
        )
    r = spec.block_size // k
    s = group.kernel_block_stride
    kernel_page = spec.real_page_size_bytes // r
    shape = list(view.shape)
    shape[view.block_dim] = (tensor.size // tensor.block_stride - 1) * s + r
    shape[view.dim("token")] = k
    token_dim = view.dim("token")
    strides = list(view.strides)
    # Inner strides are recomputed densely for the smaller block; the block
    # stride becomes one kernel page.
    scale = view.block_size // k
    for d in range(len(shape)):
        if d in (view.block_dim, token_dim):
            continue
        if strides[d] > strides[token_dim]:
            strides[d] //= scale
    strides[view.block_dim] = kernel_page // view.itemsize
    return dataclasses.replace(
        view,
        shape=tuple(shape),
        strides=tuple(strides),
        owned=(s, r) if s > r else None,
    )


def kernel_views(
    views: Mapping[str, LayerView],
    attn_groups: Iterable[Any],
    kv_cache_config: KVCacheConfig,
    runner_config: RunnerConfig,
    *,
    skip_unmapped: bool = False,
) -> dict[str, KVCacheView]:
    """The kernel-block view of every layer in `views` whose group splits blocks.

    Layers sharing one view get one kernel view. With `skip_unmapped`, groups
    whose slot mappings are not mapped are left out instead of raising.
    """
    shared = get_shared_kv_cache_layers(runner_config)
    augmented = with_kv_sharing_layers(kv_cache_config, runner_config)
    made: dict[int, KVCacheView] = {}
    out: dict[str, KVCacheView] = {}
    for group in flat_groups(attn_groups):
        if group.kernel_block_size is None:
            continue
        if skip_unmapped and not group.maps_slot_mapping:
            continue
        for name in group.layer_names:
            view = views.get(name)
            if not isinstance(view, KVCacheView):
                continue
            if id(view) not in made:
                tensor = augmented.tensor_of(shared.get(name, name))
                made[id(view)] = kernel_view(view, group, tensor)
            out[name] = made[id(view)]
    return out
