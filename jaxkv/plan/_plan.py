"""One static plan: groups, kernel block sizes, pools and every view.

One static plan: from a runner config and a block count (or a byte budget) to
groups, kernel block sizes, compile support, pools and every layer's view.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxkv._util import cdiv
from jaxkv.config import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    RunnerConfig,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from jaxkv.groups import (
    AttentionCGSupportInfo,
    AttentionGroup,
)
from jaxkv.plan._allocate import allocate_pools
from jaxkv.plan._bind import AttentionLayer, BoundKVCaches, attention_layer
from jaxkv.plan._pools import PoolSpec
from jaxkv.plan._views import KVCacheView


class LayerStack(NamedTuple):
    """What :meth:`KVCachePlan.layer_stack` returns.

    Attributes:
      layer: The first layer's :class:`AttentionLayer`, its view marked
        ``stacked``: with ``layer=slots[i]`` every read, write and
        :func:`paged_attention` addresses ``names[i]``; without ``layer=``
        they refuse it (the slot would be ambiguous).
      slots: ``(len(names),)`` int32 layer slots in the stacked pool.
      names: The layers, in scan order.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2),
      ...                        num_blocks=4, storage="stacked")
      >>> stack = plan.layer_stack(["layers.1.self_attn", "layers.0.self_attn"])
      >>> stack.slots.tolist(), stack.layer.name
      ([1, 0], 'layers.1.self_attn')
    """

    layer: AttentionLayer
    slots: np.ndarray
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class KVCachePlan:
    """Everything static about a model's KV cache, computed once.

    Built by :func:`make_plan`; later calls (:meth:`allocate`,
    :class:`StepMetadataBuilder`, the demo Engine) take the plan instead of the
    four objects it holds. Equal and hashed by value (its attention groups,
    identity-equal as in vLLM, by their fields), so it can be a static argument
    of ``jax.jit`` and a plan built again from the same arguments is the same
    key: no recompile. Nothing here is an array.

    Attributes:
      runner_config: The model's layers and limits.
      kv_cache_config: Pools and groups, KV-sharing layers included.
      attn_groups: Attention groups per KV-cache group.
      kernel_block_sizes: Kernel block size per KV-cache group (up to the first
        encoder-only group).
      cg_support: The weakest compile support of the model's backends.
      pools: Shape, dtype and carrier word of each physical pool.
      views: Every cached layer's view (KV-sharing layers alias their target's).
      storage: How pools are stored (resolved: ``"words"``, ``"typed"`` or
        ``"stacked"``; see :func:`make_plan`).
      pool_dtype: ``"element"`` or ``"bits"`` (typed pools of narrow floats).

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> [p.size_bytes for p in plan.pools], plan.block_table_widths
      ([65536, 65536], (128, 128, 128))
      >>> plan.views["layers.6.self_attn"] is plan.views["layers.3.self_attn"]
      True
    """

    runner_config: RunnerConfig
    kv_cache_config: KVCacheConfig
    attn_groups: tuple[tuple[AttentionGroup, ...], ...]
    kernel_block_sizes: tuple[int, ...]
    cg_support: AttentionCGSupportInfo
    pools: tuple[PoolSpec, ...]
    views: BoundKVCaches
    storage: str = "words"
    pool_dtype: str = "bits"

    @functools.cached_property
    def _key(self) -> tuple[Any, ...]:
        groups = tuple(
            tuple(tuple(getattr(g, f.name) for f in dataclasses.fields(g)) for g in gs)
            for gs in self.attn_groups
        )
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return tuple(groups if f is self.attn_groups else f for f in fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVCachePlan):
            return NotImplemented
        return self is other or self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def num_blocks(self) -> int:
        """Blocks per pool (block 0 is the null block)."""
        return self.kv_cache_config.num_blocks

    @functools.cached_property
    def block_sizes(self) -> tuple[int, ...]:
        """Tokens per manager block, per KV-cache group."""
        return tuple(
            g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups
        )

    @functools.cached_property
    def block_table_widths(self) -> tuple[int, ...]:
        """Block-table columns per KV-cache group for ``max_model_len``.

        ``ceil(max_model_len / block_size)`` each.

        A Mamba group has a column per block too: the state after a request's
        last computed token lives in that token's column (see
        :class:`KVCacheManager`); a Mamba spec whose block size is at least
        ``max_model_len`` has one column.
        """
        return tuple(
            cdiv(self.runner_config.max_model_len, g.kv_cache_spec.block_size)
            for g in self.kv_cache_config.kv_cache_groups
        )

    @functools.cached_property
    def group_kinds(self) -> tuple[str, ...]:
        """What each KV-cache group keeps of a sequence.

        For the block manager and the step checks.

        - ``"full"``: every block of the context (full attention, or a group
          that a layer without the group's window also reads);
        - ``"window"``: the blocks a sliding window or local chunk still shows;
        - ``"mamba"``: the block of the last computed token's state;
        - ``"encoder"``: cross-attention and encoder-only K/V, addressed by
          encoder positions.

        Example:
          >>> import jaxkv
          >>> jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4).group_kinds
          ('full', 'window', 'mamba')
        """
        cfg = self.runner_config
        kinds = []
        for g in self.kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            own = all(cfg.layer(n).spec == spec for n in g.layer_names)
            if isinstance(spec, MambaSpec):
                kinds.append("mamba")
            elif isinstance(spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
                kinds.append("encoder")
            elif own and isinstance(
                spec,
                SlidingWindowSpec | SlidingWindowMLASpec | ChunkedLocalAttentionSpec,
            ):
                kinds.append("window")
            else:
                kinds.append("full")
        return tuple(kinds)

    def attention_layer(self, name: str) -> AttentionLayer:
        """`name`'s bound view with its spec's attention parameters.

        :class:`AttentionLayer`. For :func:`paged_attention`.
        """
        return attention_layer(
            self.views, self.runner_config, name, group=self.group_of(name)
        )

    def owning_layers(self) -> list[tuple[int, str, AttentionGroup | None]]:
        """``(group, layer, attention group)`` of every layer owning its view.

        ``(KV-cache group, layer, attention group)`` of every layer owning its
        view, in group order (KV-sharing layers read their target's view and
        are left out; the attention group is ``None`` for a Mamba layer).

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
          >>> [(g, name) for g, name, _ in plan.owning_layers()][:3]
          [(0, 'layers.0.self_attn'), (0, 'layers.3.self_attn'), (1, 'layers.1.self_attn')]
        """  # noqa: E501
        seen: set[int] = set()
        out: list[tuple[int, str, AttentionGroup | None]] = []
        for g, groups in enumerate(self.attn_groups):
            for group in groups:
                for name in group.layer_names:
                    view = self.views[name]
                    if id(view) in seen:
                        continue
                    seen.add(id(view))
                    attn = group if isinstance(view, KVCacheView) else None
                    out.append((g, name, attn))
        return out

    def group_of(self, name: str) -> int | None:
        """The KV-cache group whose metadata layer `name` reads.

        Its target's for a KV-sharing layer. ``None`` for a layer of no group.

        Example:
          >>> import jaxkv
          >>> cfg = jaxkv.pattern_config("LLGG", num_layers=4, sliding_window=8,
          ...                            num_heads=2, num_kv_heads=1, head_size=8)
          >>> plan = jaxkv.make_plan(cfg, num_blocks=8)
          >>> [plan.group_of(f"layers.{i}.self_attn") for i in range(4)]
          [0, 0, 1, 1]
        """
        for gid, groups in enumerate(self.attn_groups):
            if any(name in g.layer_names for g in groups):
                return gid
        return None

    def layer_stack(self, names: Sequence[str]) -> LayerStack:
        """The layers `names` as one stack to ``lax.scan`` over.

        Every layer must be an attention layer of one stacked typed pool
        (``storage="stacked"``) with the same view and attention parameters
        but for its slot, so one :class:`AttentionLayer` serves them all and
        ``slots[i]`` (traced inside the scan) picks layer ``names[i]``.

        Raises:
          ValueError: If a name is given twice, the layers belong to different
            KV-cache groups (they
            read different block tables: one scan reads one group's
            metadata), live in different pools, in a word pool, or differ in
            view or attention parameters (naming the first two that
            disagree).

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=3),
          ...                        num_blocks=4, storage="stacked")
          >>> stack = plan.layer_stack([f"layers.{i}.self_attn" for i in range(3)])
          >>> stack.slots.tolist(), stack.layer.view.pool
          ([0, 1, 2], 0)
        """
        names = list(names)
        if not names:
            raise ValueError("layer_stack: names is empty.")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"layer_stack: {twice} given more than once (a scan over the "
                "stack would write and read those layers' slot twice a step)."
            )
        layers = [self.attention_layer(n) for n in names]
        first = layers[0]
        for layer in layers[1:]:
            if layer.group != first.group:
                raise ValueError(
                    f"layer_stack: layers {first.name!r} (KV-cache group "
                    f"{first.group}) and {layer.name!r} (group {layer.group}) read "
                    "different groups' metadata (block tables, slot mappings); "
                    "one scan reads one group's metadata. Stack each group's "
                    "layers on their own (plan.group_of(name))."
                )
        if not first.view.typed:
            raise ValueError(
                f"layer_stack: layer {first.name!r} lives in a word pool; plan with "
                f"storage='stacked' (this plan's storage is {self.storage!r})."
            )
        base = dataclasses.replace(
            first, view=dataclasses.replace(first.view, layer=0, offset=0)
        )
        for layer in layers[1:]:
            other = dataclasses.replace(
                layer,
                name=first.name,
                view=dataclasses.replace(layer.view, layer=0, offset=0),
            )
            if other != base:
                raise ValueError(
                    f"layer_stack: layers {first.name!r} and {layer.name!r} cannot be "
                    "scanned together: they differ in pool, view or attention "
                    "parameters (window, chunk, soft cap); scan each kind of layer "
                    "on its own."
                )
        return LayerStack(
            # The view stands for every layer: each access must name its slot.
            layer=dataclasses.replace(
                first, view=dataclasses.replace(first.view, stacked=True)
            ),
            slots=np.asarray([layer.view.layer for layer in layers], np.int32),
            names=tuple(names),
        )

    @property
    def pool_bytes(self) -> int:
        """Bytes of all pools together."""
        return sum(p.size_bytes for p in self.pools)

    def allocate(
        self, *, sharding: jax.sharding.Sharding | None = None
    ) -> tuple[jax.Array, ...]:
        """Zero-initialised pool arrays, made under jit (see :func:`allocate_pools`).

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
          >>> [p.shape for p in plan.allocate()]
          [(16384,), (16384,)]
        """
        return allocate_pools(self.pools, sharding)
