"""Binding views to layers and slot mappings to layers (spec §2.14, §2.15)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
from jax.typing import ArrayLike
from jaxtyping import Int

from jaxkv.config import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    RunnerConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_shared_kv_cache_layers,
)
from jaxkv.groups import AttentionGroup, with_kv_sharing_layers
from jaxkv.plan._kernel_views import kernel_views
from jaxkv.plan._views import KVCacheView, LayerView


class BoundKVCaches(Mapping[str, LayerView]):
    """Immutable ``layer -> view`` binding handed to a model function.

    Aliased (KV-sharing) layers map to the same view object, so the pool they
    share appears once in the pools tuple and is donated once.
    ``uncached_layers`` lists forward-context layers that have no cache; looking
    one up raises a ``KeyError`` that says so.
    """

    def __init__(self, views: dict[str, LayerView], uncached_layers: tuple[str, ...]):
        """Wraps `views`; `uncached_layers` are reported on lookup."""
        self._views = dict(views)
        self.uncached_layers = uncached_layers

    def __getitem__(self, name: str) -> LayerView:
        """The view bound to `name`."""
        try:
            return self._views[name]
        except KeyError:
            if name in self.uncached_layers:
                raise KeyError(
                    f"Layer {name!r} is in the forward context but has no KV cache "
                    "(no spec, or in no KV-cache group)."
                ) from None
            raise KeyError(f"Layer {name!r} is not in the forward context.") from None

    def __iter__(self) -> Iterator[str]:
        """Bound layer names."""
        return iter(self._views)

    def __len__(self) -> int:
        """Number of bound layers."""
        return len(self._views)

    def __hash__(self) -> int:
        """Hash of the binding; equal bindings hash equally (order ignored)."""
        return hash((frozenset(self._views.items()), frozenset(self.uncached_layers)))

    def __eq__(self, other: object) -> bool:
        """Equal bindings bind equal views to the same layers."""
        if isinstance(other, BoundKVCaches):
            return self._views == other._views and set(self.uncached_layers) == set(
                other.uncached_layers
            )
        return NotImplemented

    def __repr__(self) -> str:
        """A short summary."""
        return (
            f"BoundKVCaches({list(self._views)}, uncached={list(self.uncached_layers)})"
        )


def bind_kv_caches(
    kv_caches: Mapping[str, LayerView],
    forward_context: Collection[str] | Mapping[str, Any],
    kv_cache_config: KVCacheConfig,
    vllm_config: RunnerConfig,
    attn_groups: Sequence[Sequence[AttentionGroup]] | Sequence[AttentionGroup] = (),
) -> BoundKVCaches:
    """Bind per-layer KV cache views to the attention layers.

    KV-sharing layers resolve to their target's view; only layers in
    `forward_context` are bound; layers of attention groups with a kernel block
    size get their kernel view (the §1.8 packed mapping where the view is still
    at manager granularity). `kv_caches` is not modified.

    Args:
      kv_caches: ``layer -> view`` from :func:`init_kv_cache`.
      forward_context: Names (or a mapping keyed by names) of the layers this
        runner executes.
      kv_cache_config: Pools and groups.
      vllm_config: The runner configuration.
      attn_groups: From :func:`init_attn_backend`.

    Returns:
      The immutable binding.

    Raises:
      ValueError: If a split packed group's slot mappings are not mapped.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
      >>> bound = jaxkv.vllm.bind_kv_caches(views, ["layers.3.self_attn",
      ...     "layers.6.self_attn", "encoder.attn"], kv, cfg, groups)
      >>> bound["layers.6.self_attn"] is bound["layers.3.self_attn"]
      True
      >>> bound.uncached_layers
      ('encoder.attn',)
    """
    if isinstance(forward_context, str):
        raise TypeError(
            f"bind_kv_caches: forward_context must be a collection of layer names, "
            f"got the string {forward_context!r}; pass [{forward_context!r}]."
        )
    shared = get_shared_kv_cache_layers(vllm_config)
    views = dict(kv_caches)
    for layer, target in shared.items():
        if layer not in views and target in views:
            views[layer] = views[target]
    context = list(forward_context)
    bound = {name: views[name] for name in context if name in views}
    uncached = tuple(name for name in context if name not in views)
    # A view any of whose layers has a window or local chunk is marked, so a
    # bare view is never read as full attention (aliases stay one object).
    windowed = {
        id(view)
        for name, view in bound.items()
        if isinstance(view, KVCacheView)
        and local_attention(vllm_config.layer(name).spec) != (None, None)
    }
    marked: dict[int, KVCacheView] = {}
    for name, view in bound.items():
        if id(view) in windowed and isinstance(view, KVCacheView):
            bound[name] = marked.setdefault(
                id(view), dataclasses.replace(view, windowed=True)
            )
    bound.update(kernel_views(bound, attn_groups, kv_cache_config, vllm_config))
    return BoundKVCaches(_with_groups(bound, kv_cache_config, shared), uncached)


def _with_groups(
    bound: dict[str, LayerView],
    kv_cache_config: KVCacheConfig,
    shared: Mapping[str, str],
) -> dict[str, LayerView]:
    """`bound` with each attention view marked with the groups bound to it.

    Aliases stay one object; a layer of no group (cross-attention without
    one, a config's extra layer) adds nothing.
    """
    of_view: dict[int, set[int]] = {}
    for name, view in bound.items():
        if not isinstance(view, KVCacheView):
            continue
        try:
            gid = kv_cache_config.group_of(shared.get(name, name))
        except KeyError:
            continue
        of_view.setdefault(id(view), set()).add(gid)
    marked: dict[int, LayerView] = {}
    out = {}
    for name, view in bound.items():
        if id(view) in of_view and isinstance(view, KVCacheView):
            gids = tuple(sorted(of_view[id(view)]))
            view = marked.setdefault(id(view), dataclasses.replace(view, groups=gids))
        out[name] = view
    return out


def build_slot_mappings_by_layer(
    slot_mappings: Sequence[Any],
    kv_cache_config: KVCacheConfig,
    *,
    runner_config: RunnerConfig | None = None,
) -> dict[str, Any]:
    """Pairs row ``i`` of `slot_mappings` with KV-cache group ``i``, per layer.

    Rows are not copied: every layer of a group gets the same row object. Extra
    groups (or rows) are ignored. With `runner_config`, KV-sharing layers get
    their target group's row.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> groups = [jaxkv.vllm.KVCacheGroupSpec(layer_names=n, kv_cache_spec=spec)
      ...           for n in (["a", "b"], ["c"], ["d"])]
      >>> kv = jaxkv.vllm.KVCacheConfig(num_blocks=1, kv_cache_tensors=[],
      ...                          kv_cache_groups=groups)
      >>> jaxkv.plan.build_slot_mappings_by_layer(["R0", "R1"], kv)
      {'a': 'R0', 'b': 'R0', 'c': 'R1'}
    """
    if runner_config is not None:
        kv_cache_config = with_kv_sharing_layers(kv_cache_config, runner_config)
    return {
        name: row
        for row, group in zip(
            slot_mappings, kv_cache_config.kv_cache_groups, strict=False
        )
        for name in group.layer_names
    }


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    """A layer's bound view with the attention parameters its spec fixes.

    Pass it to :func:`paged_attention` instead of the bare view: the window,
    local chunk, soft cap and cross-attention then come from the layer, and
    an explicit argument that contradicts them raises. A KV-sharing layer
    gets its target's view and its own parameters. Static (hashable), like a
    view.

    Attributes:
      name: The layer.
      view: Its bound view.
      sliding_window: Keys within the last this-many positions (``None``: all).
      attention_chunk_size: Keys in the query's local chunk only.
      logits_soft_cap: From :class:`LayerConfig`.
      cross_attention: Keys are the cached encoder K/V.
      group: The KV-cache group whose metadata the layer reads (set by
        ``plan.attention_layer``; ``None``: unknown, unchecked).
        :func:`paged_attention` refuses another group's metadata.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> layer = plan.attention_layer("layers.7.self_attn")  # reads layer 4
      >>> layer.sliding_window, layer.view is plan.views["layers.4.self_attn"]
      (64, True)
    """

    name: str
    view: KVCacheView
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    logits_soft_cap: float | None = None
    cross_attention: bool = False
    group: int | None = None


@runtime_checkable
class GroupSlots(Protocol):
    """A step's metadata for one KV-cache group, as :func:`write_kv` reads it.

    ``CommonAttentionMetadata`` is one.
    """

    @property
    def slot_mapping(self) -> Int[ArrayLike, " num_tokens"]:  # noqa: D102
        ...

    @property
    def group(self) -> int | None:  # noqa: D102
        ...


def attention_layer(
    views: Mapping[str, LayerView],
    runner_config: RunnerConfig,
    name: str,
    *,
    group: int | None = None,
) -> AttentionLayer:
    """`name`'s :class:`AttentionLayer` from its bound view and its spec.

    Raises:
      KeyError: If `name` is not bound.
      TypeError: If `name` is a Mamba layer (no attention).
    """
    view = views[name]
    if not isinstance(view, KVCacheView):
        raise TypeError(
            f"attention_layer: layer {name!r} has a {type(view).__name__}, not an "
            "attention view."
        )
    layer = runner_config.layer(name)
    spec = layer.spec
    window, chunk = local_attention(spec)
    return AttentionLayer(
        name=name,
        view=view,
        sliding_window=window,
        attention_chunk_size=chunk,
        logits_soft_cap=layer.logits_soft_cap,
        cross_attention=isinstance(spec, CrossAttentionSpec)
        or layer.attn_type == "encoder_decoder",
        group=group,
    )


def local_attention(spec: object) -> tuple[int | None, int | None]:
    """``(sliding_window, attention_chunk_size)`` of a layer's spec.

    ``(sliding_window, attention_chunk_size)`` a layer's spec gives its
    attention (``None`` where it has none).

    Example:
      >>> import jaxkv
      >>> jaxkv.plan.local_attention(jaxkv.SlidingWindowSpec(block_size=16,
      ...     num_kv_heads=1, head_size=8, dtype="float32", sliding_window=32))
      (32, None)
    """
    if isinstance(spec, SlidingWindowSpec | SlidingWindowMLASpec):
        return spec.sliding_window, None
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return None, spec.attention_chunk_size
    if isinstance(spec, FullAttentionSpec):
        return spec.sliding_window, spec.attention_chunk_size
    return None, None
