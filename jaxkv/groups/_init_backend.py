"""init_attn_backend: attention groups, kernel sizes, compile support (spec §2.7)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from jaxkv._util import is_int
from jaxkv.config import (
    AttentionBackend,
    AttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    RunnerConfig,
    add_kv_sharing_layers_to_kv_cache_groups,
    create_fast_prefill_custom_backend,
    get_kv_sharing_fast_prefill_eligible_layers,
    get_shared_kv_cache_layers,
    layer_spec,
    packed_tensor_of_layers,
    representative_spec,
)
from jaxkv.groups._attn_group import AttentionGroup, flat_groups
from jaxkv.groups._cg_support import AttentionCGSupportInfo, get_attn_cg_support
from jaxkv.groups._kernel_blocks import (
    kernel_block_sizes_by_group,
    select_common_block_size,
)


def with_kv_sharing_layers(
    kv_cache_config: KVCacheConfig, runner_config: RunnerConfig
) -> KVCacheConfig:
    """`kv_cache_config` with the model's KV-sharing layers in their target's group.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
      >>> "layers.6.self_attn" in jaxkv.groups.with_kv_sharing_layers(kv, cfg).kv_cache_groups[0].layer_names
      True
    """  # noqa: E501
    return add_kv_sharing_layers_to_kv_cache_groups(
        get_shared_kv_cache_layers(runner_config), kv_cache_config
    )


# What a layer's K/V (or state) looks like: a group spec must agree with its
# layers' specs on these (the page may be padded, the window may differ).
_SHAPE_FIELDS = (
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "shapes",
    "dtypes",
)


def _validate_group_layers(
    kv_cache_config: KVCacheConfig,
    runner_config: RunnerConfig,
    shared: dict[str, str],
) -> None:
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            if name not in runner_config:
                raise ValueError(
                    f"KV-cache group {gid} lists layer {name!r}, which is not an "
                    "attention-like layer of the model."
                )
            if name not in shared and runner_config.layer(name).spec is None:
                raise ValueError(
                    f"KV-cache group {gid} lists layer {name!r}, which has no "
                    "KV-cache spec."
                )
            own = runner_config.layer(name).spec
            if name in shared or own is None:
                continue
            group_spec = layer_spec(group.kv_cache_spec, name)
            for field in _SHAPE_FIELDS:
                want, got = getattr(own, field, None), getattr(group_spec, field, None)
                if want != got:
                    raise ValueError(
                        f"KV-cache group {gid}'s spec gives layer {name!r} "
                        f"{field}={got!r}, but the layer's own spec has {want!r}; "
                        "its view would not match its K/V."
                    )


class AttnBackendInit(NamedTuple):
    """What :func:`init_attn_backend` returns; unpacks like vLLM's tuple.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> init = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> init.kernel_block_sizes, init.cg_support_info.min_cg_support.name
      ([32, 32, 32], 'UNIFORM_BATCH')
    """

    attn_groups: list[list[AttentionGroup]]
    """Attention groups per KV-cache group."""
    cg_support_info: AttentionCGSupportInfo
    """The weakest compile support and the backend that set it."""
    kernel_block_sizes: list[int]
    """One kernel block size per KV-cache group (up to encoder-only groups)."""


def init_attn_backend(
    kv_cache_config: KVCacheConfig,
    vllm_config: RunnerConfig,
    device: Any = None,
    active_layer_names: Collection[str] | None = None,
    draft_layer_names: Collection[str] | None = None,
    maps_slot_mapping: bool = False,
    slot_mapped_layers: Collection[str] = (),
) -> AttnBackendInit:
    """Groups the layers by backend and spec and picks kernel block sizes.

    Pure Python over static data: compiles nothing. KV-sharing layers join their
    target's group (idempotently). Fast-prefill-eligible layers get the wrapped
    backend ``"FastPrefill" + name`` and so a group of their own.

    Args:
      kv_cache_config: Pools and KV-cache groups.
      vllm_config: The runner configuration.
      device: The seed's placement argument. jaxkv places nothing here (pools
        are placed by :func:`init_kv_cache` or :meth:`KVCachePlan.allocate`
        with a sharding), so only ``None`` is accepted.
      active_layer_names: Only these layers are grouped (a speculator passes its
        draft layers); group order is preserved.
      draft_layer_names: Layers the fast-prefill suffix walk skips.
      maps_slot_mapping: The caller maps every slot mapping it builds to kernel
        blocks (:meth:`AttentionGroup.map_to_kernel_slot_mapping`).
      slot_mapped_layers: Otherwise, the layers whose slot mappings are mapped
        (written by another runner).

    Returns:
      ``(attn_groups, cg_support_info, kernel_block_sizes)``: attention groups
      per KV-cache group, the weakest compile support, and one kernel block size
      per KV-cache group up to the first encoder-only group.

    Raises:
      ValueError: For a group layer that is unknown or has no spec, or a group
        without a common kernel block size.
      RuntimeError: If batch invariance is required and a backend lacks it.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=8)
      >>> groups, info, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> [len(g) for g in groups], sizes, info.min_cg_support.name
      ([2, 2, 1], [32, 32, 32], 'UNIFORM_BATCH')
    """
    if device is not None:
        raise ValueError(
            f"init_attn_backend: device={device!r} is not used by jaxkv, which "
            "groups layers without placing anything; pass device=None and place the "
            "pools with init_kv_cache(sharding=...) or KVCachePlan.allocate."
        )
    shared = get_shared_kv_cache_layers(vllm_config)
    kv_cache_config = add_kv_sharing_layers_to_kv_cache_groups(shared, kv_cache_config)
    _validate_group_layers(kv_cache_config, vllm_config, shared)
    eligible = get_kv_sharing_fast_prefill_eligible_layers(
        vllm_config, draft_layer_names
    )
    active = None if active_layer_names is None else set(active_layer_names)

    # Phase 1: one attention group per (backend, per-layer spec, query heads).
    proto: list[list[AttentionGroup]] = []
    for gid, group_spec in enumerate(kv_cache_config.kv_cache_groups):
        if not representative_spec(group_spec.kv_cache_spec).has_layer_views:
            proto.append([])  # no per-layer views: no attention group (§2.7.2)
            continue
        by_key: dict[tuple[AttentionBackend, KVCacheSpec, int], list[str]] = {}
        for name in group_spec.layer_names:
            if active is not None and name not in active:
                continue
            layer = vllm_config.layer(name)
            backend = layer.backend
            if vllm_config.batch_invariant and not backend.supports_batch_invariance:
                raise RuntimeError(
                    f"Layer {name!r} uses {backend.class_name}, which does not "
                    "support batch invariance, but batch_invariant=True."
                )
            if name in eligible:
                backend = create_fast_prefill_custom_backend("FastPrefill", backend)
            spec = layer_spec(group_spec.kv_cache_spec, shared.get(name, name))
            if (
                isinstance(spec, AttentionSpec)
                and spec.is_packed
                and not backend.reads_packed_pages
            ):
                raise ValueError(
                    f"Layer {name!r}: its {type(spec).__name__} packs its pages "
                    f"(tokens_per_state={spec.tokens_per_state}, num_head_slots="
                    f"{spec.num_head_slots}, state_content_bytes="
                    f"{spec.state_content_bytes}, storage_block_size="
                    f"{getattr(spec, 'storage_block_size', None)}), but "
                    f"{backend.class_name} reads "
                    "one K/V slot per KV head and token; give the layer a backend "
                    "with reads_packed_pages=True (its kernel reads the view "
                    "jaxkv.plan.packed_view describes)."
                )
            by_key.setdefault((backend, spec, layer.num_heads), []).append(name)
        proto.append(
            [
                AttentionGroup(
                    backend=backend,
                    layer_names=tuple(names),
                    kv_cache_spec=spec,
                    kv_cache_group_id=gid,
                    num_heads=heads,
                    fast_prefill=names[0] in eligible,
                )
                for (backend, spec, heads), names in by_key.items()
            ]
        )

    # Phase 2: kernel block size per KV-cache group.
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, proto)
    size_of_group = kernel_block_sizes_by_group(kv_cache_config, kernel_block_sizes)

    # Phase 3: per attention group refinement (what vLLM's builders do).
    slot_mapped = set(slot_mapped_layers)
    attn_groups = [
        [
            _refine(
                g,
                size_of_group.get(g.kv_cache_group_id),
                kv_cache_config,
                maps_slot_mapping or not slot_mapped.isdisjoint(g.layer_names),
            )
            for g in groups
        ]
        for groups in proto
    ]
    return AttnBackendInit(
        attn_groups=attn_groups,
        cg_support_info=get_attn_cg_support(attn_groups, vllm_config),
        kernel_block_sizes=kernel_block_sizes,
    )


def check_kernel_block_sizes(
    kv_cache_config: KVCacheConfig,
    kernel_block_sizes: Sequence[int],
    attn_groups: Sequence[Sequence[AttentionGroup]] = (),
) -> None:
    """Checks kernel block sizes against the groups they are for.

    One entry per KV-cache group that is not encoder-only, each a positive
    divisor of its group's block size (each attention group then picks the
    largest size its backend supports within it).

    Raises:
      ValueError: Naming the entry, the group's layers, what was expected and
        what came.
    """
    expected = [
        gid
        for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        if not isinstance(
            representative_spec(group.kv_cache_spec), EncoderOnlyAttentionSpec
        )
    ]
    sizes = list(kernel_block_sizes)
    if len(sizes) != len(expected):
        raise ValueError(
            f"kernel_block_sizes has {len(sizes)} entries, expected {len(expected)} "
            "(one per KV-cache group that is not encoder-only, as init_attn_backend "
            f"returns them), got {sizes}."
        )
    for i, (gid, k) in enumerate(zip(expected, sizes, strict=True)):
        group = kv_cache_config.kv_cache_groups[gid]
        bs = group.kv_cache_spec.block_size
        if not is_int(k) or k <= 0 or bs % k:
            raise ValueError(
                f"kernel_block_sizes[{i}]={k!r} must be a positive divisor of the "
                f"block size {bs} of group {gid} ({list(group.layer_names)[:2]}...)."
            )
        # Each attention group refined its kernel blocks from this entry (a
        # divisor of it); views at another granularity address other pages.
        for attn in flat_groups(attn_groups):
            if attn.kv_cache_group_id != gid or not isinstance(
                attn.kv_cache_spec, AttentionSpec
            ):
                continue
            own = attn.kernel_block_size or attn.kv_cache_spec.block_size
            if k % own:
                raise ValueError(
                    f"kernel_block_sizes[{i}]={k} disagrees with attn_groups: the "
                    f"attention group of {list(attn.layer_names)[:2]} (KV-cache group "
                    f"{gid}) reads kernel blocks of {own} tokens, which must divide "
                    "it; pass the kernel_block_sizes init_attn_backend returned "
                    "with these attn_groups."
                )


def _refine(
    group: AttentionGroup,
    group_kernel_size: int | None,
    kv_cache_config: KVCacheConfig,
    maps_slot_mapping: bool,
) -> AttentionGroup:
    spec = group.kv_cache_spec
    if group_kernel_size is None or not isinstance(spec, AttentionSpec):
        return dataclasses.replace(group, maps_slot_mapping=maps_slot_mapping)
    k = select_common_block_size(group_kernel_size, [group.backend])
    if k == spec.block_size:
        return dataclasses.replace(group, maps_slot_mapping=maps_slot_mapping)
    stride = 0
    packed = packed_tensor_of_layers(kv_cache_config, group.layer_names)
    if packed is not None:
        kernel_page = spec.real_page_size_bytes // (spec.block_size // k)
        if packed.block_stride % kernel_page:
            raise ValueError(
                f"Layers {list(group.layer_names)} need kernel blocks of {k} tokens "
                f"({kernel_page} bytes), but their packed block_stride="
                f"{packed.block_stride} is not a multiple of that."
            )
        stride = packed.block_stride // kernel_page
    return dataclasses.replace(
        group,
        kernel_block_size=k,
        kernel_block_stride=stride,
        maps_slot_mapping=maps_slot_mapping,
    )


def prepare_kernel_block_sizes(
    kv_cache_config: KVCacheConfig,
    attn_groups: Sequence[Sequence[AttentionGroup]],
) -> list[int]:
    """One kernel block size per KV-cache group, in group order (spec §1.6).

    Encoder-only groups append **no** entry (as in vLLM), so the list can be
    shorter than the group list; consumers look sizes up by group id with
    :func:`kernel_block_sizes_by_group`, never by list position.
    Mamba and packed attention groups keep their manager block size.

    Args:
      kv_cache_config: The KV-cache configuration.
      attn_groups: Attention groups per KV-cache group.

    Returns:
      The kernel block sizes.

    Raises:
      ValueError: If an attention group has no common kernel block size.
      NotImplementedError: For a spec type this module does not know.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=80, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> cfg = jaxkv.vllm.KVCacheConfig(num_blocks=2,
      ...     kv_cache_tensors=[jaxkv.vllm.KVCacheTensor(size=2 * spec.page_size_bytes,
      ...                                           shared_by=["a"])],
      ...     kv_cache_groups=[jaxkv.vllm.KVCacheGroupSpec(layer_names=["a"],
      ...                                             kv_cache_spec=spec)])
      >>> group = jaxkv.vllm.AttentionGroup(backend=jaxkv.get_backend("FLASHINFER"),
      ...     layer_names=("a",), kv_cache_spec=spec, kv_cache_group_id=0)
      >>> jaxkv.vllm.prepare_kernel_block_sizes(cfg, [[group]])
      [16]
    """
    sizes: list[int] = []
    for gid, group_spec in enumerate(kv_cache_config.kv_cache_groups):
        spec = representative_spec(group_spec.kv_cache_spec)
        block_size = group_spec.kv_cache_spec.block_size
        if isinstance(spec, EncoderOnlyAttentionSpec):
            continue
        if not spec.has_layer_views or isinstance(spec, MambaSpec):
            sizes.append(block_size)
        elif isinstance(spec, AttentionSpec):
            if packed_tensor_of_layers(kv_cache_config, group_spec.layer_names):
                sizes.append(block_size)
                continue
            groups = attn_groups[gid] if gid < len(attn_groups) else ()
            sizes.append(
                select_common_block_size(block_size, [g.backend for g in groups])
            )
        else:
            raise NotImplementedError(
                f"Kernel block sizes for {type(spec).__name__} (group {gid}) are not "
                "supported."
            )
    return sizes
