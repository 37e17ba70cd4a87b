"""vLLM 0.33's description of KV-cache storage: permutations of ``[L, B, H, N, C]``.

vLLM 0.33 (2026-11-01) allocates one backing buffer and places every set of
same-shaped layers in it with a :class:`LayerTensor` ``(size, layers,
layer_stride, block_stride, offset)``: layer ``layers[l]``'s page for block
``b`` starts at ``offset + l * layer_stride + b * block_stride`` bytes. Each
tensor is a logical ``[L, B, H, N, C]`` byte array (layers, kernel blocks,
heads, states per block, content bytes: ``(D + Dv) * itemsize`` per head and
token for attention, K then V), laid out in memory in the axis order a
:class:`TensorLayout` names, then viewed per layer in its dtype.

This module is that model, computed exactly (the facts of vLLM's
``kv_cache_layout.py``, ``compute_layout_strides``, ``create_kv_cache_views``
and ``resolve_kv_cache_layout``): strides, the resolution of one layout from
the backends' supported lists, the tensors of a jaxkv plan, and per-layer
:class:`KVCacheView` s of a word pool that address every byte where vLLM
0.33's views do. The seed-named functions (``init_kv_cache`` and friends)
follow vLLM 0.32's pre-refactor model, as the seeds do.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jaxkv._specs import AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec
from jaxkv.cache._pools import PoolSpec
from jaxkv.cache._views import KVCacheView

_L, _B, _H, _N, _C = range(5)


class TensorLayout(enum.Enum):
    """A physical order of the logical ``[L, B, H, N, C]`` axes (vLLM 0.33's
    ``KVCacheLayout``); the value is the stride order, outermost first.

    Example:
      >>> import jaxkv
      >>> lay = jaxkv.vllm.TensorLayout.LBNHC  # vLLM 0.33's default (FlashAttention)
      >>> lay.is_layer_compact, lay.is_block_compact, lay.is_block_outermost
      (True, True, False)
    """  # noqa: D205

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)

    @property
    def stride_order(self) -> tuple[int, ...]:
        """Logical axes from outermost to innermost in memory."""
        return self.value

    @property
    def is_layer_compact(self) -> bool:
        """The layer axis is outermost: each layer is one contiguous region."""
        return self.value[0] == _L

    @property
    def is_block_compact(self) -> bool:
        """L and B are the two outermost axes: each page is one contiguous run."""
        return set(self.value[:2]) == {_L, _B}

    @property
    def is_block_outermost(self) -> bool:
        """B is outermost: a block holds every layer's page."""
        return self.value[0] == _B


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerTensor:
    """vLLM 0.33's ``KVCacheTensor``: a set of same-shaped layers in the backing.

    Layer ``layers[l]``'s page for block ``b`` starts at byte ``offset + l *
    layer_stride + b * block_stride``. Tensors whose ranges overlap alias the
    same bytes (groups overlay each other; a block id belongs to one group at
    a time).

    Example:
      >>> import jaxkv
      >>> t = jaxkv.vllm.LayerTensor(size=1 << 20, layers=("a", "b"),
      ...                       layer_stride=1 << 19, block_stride=4096)
      >>> t.page_start(layer=1, block=3)
      536576
    """

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0

    def page_start(self, *, layer: int, block: int) -> int:
        """Byte where layer index `layer`'s page of block `block` starts."""
        return self.offset + layer * self.layer_stride + block * self.block_stride


def hnc_shape(
    spec: KVCacheSpec, kernel_block_size: int | None = None
) -> tuple[int, int, int]:
    """``(H, N, C)`` of one (kernel) block: heads, states, content bytes.

    Attention: KV heads, tokens per kernel block, ``(D + Dv) * itemsize``
    (K then V of one head and token side by side); MLA: 1 head, ``D *
    itemsize``; Mamba: one state of all its bytes.

    Raises:
      TypeError: For a spec with no per-layer view in vLLM 0.33's model.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8,
      ...                                head_size=128, dtype="bfloat16")
      >>> jaxkv.vllm.hnc_shape(spec), jaxkv.vllm.hnc_shape(spec, kernel_block_size=8)
      ((8, 16, 512), (8, 8, 512))
    """
    if isinstance(spec, MambaSpec):
        return 1, 1, spec.real_page_size_bytes
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"{type(spec).__name__} has no [L, B, H, N, C] view.")
    k = kernel_block_size or spec.block_size
    if spec.block_size % k:
        raise ValueError(
            f"kernel_block_size={k} does not divide the block size {spec.block_size}."
        )
    itemsize = np.dtype(spec.dtype).itemsize
    heads = 1 if isinstance(spec, MLAAttentionSpec) else spec.num_kv_heads
    return heads, k, (spec.head_size + (spec.head_size_v or 0)) * itemsize


def layout_strides(
    spec: KVCacheSpec,
    *,
    num_blocks: int,
    num_layers: int,
    layout: TensorLayout,
    kernel_block_size: int | None = None,
    layer_stride: int | None = None,
    block_stride: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and byte strides of a tensor in logical ``[L, B, H, N, C]`` order.

    Dense in `layout`'s order, except that a padded page (``page_size_padded``)
    rounds the page grid's innermost stride up to the padded page, and a given
    `layer_stride` / `block_stride` (a :class:`LayerTensor`'s) wins. With kernel
    blocks smaller than the manager block, ``B`` counts kernel blocks and the
    block stride is divided among them: vLLM refuses that unless a block is one
    dense, unpadded page.

    Raises:
      ValueError: For a kernel-block split of a padded or packed page.

    Example (LBNHC, 2 layers of 4 blocks of 16 tokens, 8 heads x 128, bf16):
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8,
      ...                                head_size=128, dtype="bfloat16")
      >>> jaxkv.vllm.layout_strides(spec, num_blocks=4, num_layers=2,
      ...                      layout=jaxkv.vllm.TensorLayout.LBNHC)
      ((2, 4, 8, 16, 512), (262144, 65536, 512, 4096, 1))
    """
    heads, states, content = hnc_shape(spec, kernel_block_size)
    ratio = (spec.block_size // states) if isinstance(spec, AttentionSpec) else 1
    shape = (num_layers, num_blocks * ratio, heads, states, content)
    padded = getattr(spec, "page_size_padded", None)
    dense_page = heads * states * content * ratio
    if ratio > 1:
        page = block_stride if block_stride is not None else dense_page
        if padded is not None or page != dense_page:
            raise ValueError(
                f"The {layout.name} layout does not store blocks as dense, unpadded "
                f"pages (block stride {page} != page {dense_page}), so a block cannot "
                f"be split into {ratio} kernel blocks of {states} tokens; use a block "
                "size equal to the kernel block size."
            )
        if block_stride is not None:
            block_stride //= ratio
    order = layout.stride_order
    strides = [0] * 5
    fixed = [layer_stride, block_stride, None, None, None]
    grid_end = max(order.index(_L), order.index(_B)) + 1 if padded else -1
    current = 1
    for physical, dim in reversed(tuple(enumerate(order))):
        if padded is not None and physical == grid_end - 1:
            current = max(current, padded)
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return shape, tuple(strides)


def resolve_layout(
    supported: Sequence[Sequence[TensorLayout]],
    specs: Iterable[KVCacheSpec] = (),
    *,
    requested: TensorLayout | None = None,
) -> TensorLayout:
    """One layout for the whole model, as vLLM 0.33's ``resolve_kv_cache_layout``.

    `supported` holds each worker's list (most preferred first; all must
    agree). Specs whose ``(H, N, page bytes)`` differ can only alias pages in
    a block-compact layout, so the candidates narrow to those. `requested`
    (vLLM's ``VLLM_KV_CACHE_LAYOUT``) must be a candidate; otherwise the first
    candidate wins.

    Raises:
      ValueError: If the lists are empty or disagree, no candidate is left, or
        `requested` is not a candidate.

    Example:
      >>> import jaxkv
      >>> L = jaxkv.vllm.TensorLayout
      >>> jaxkv.vllm.resolve_layout([[L.BLNHC, L.LBNHC]])
      <TensorLayout.BLNHC: (1, 0, 3, 2, 4)>
    """
    lists = [list(s) for s in supported]
    if not lists or not all(lists):
        raise ValueError("resolve_layout: no supported layouts were given.")
    if any(names != lists[0] for names in lists[1:]):
        raise ValueError(f"resolve_layout: workers disagree on layouts: {lists}.")
    candidates = lists[0]
    shapes = {
        (*hnc_shape(s)[:2], s.page_size_bytes)
        for s in specs
        if isinstance(s, AttentionSpec | MambaSpec)
    }
    if len(shapes) > 1:
        candidates = [c for c in candidates if c.is_block_compact]
        if not candidates:
            raise ValueError(
                "resolve_layout: specs with mixed (H, N, page) shapes "
                f"{sorted(shapes)} need a block-compact layout, but none is in "
                f"every supported set: {[[c.name for c in s] for s in lists]}."
            )
    if requested is not None:
        if requested not in candidates:
            raise ValueError(
                f"resolve_layout: requested {requested.name} is not a valid layout "
                f"here; valid: {[c.name for c in candidates]}."
            )
        return requested
    return candidates[0]


def tensor_views(
    tensor: LayerTensor,
    spec: AttentionSpec,
    *,
    num_blocks: int,
    layout: TensorLayout,
    kernel_block_size: int | None = None,
    pool: int = 0,
    word: int = 4,
) -> dict[str, KVCacheView]:
    """Every layer's view of `tensor` in a flat word pool, where vLLM 0.33's
    ``create_kv_cache_views`` puts it: a fused K|V view ``(blocks, tokens, H,
    D + Dv)`` (MLA: ``(blocks, tokens, D)``) whose element ``(b, n, h, c)`` is at
    byte ``offset + l * layer_stride + b * s_B + h * s_H + n * s_N + c *
    itemsize``, over a pool of `word`-byte carrier words
    (``PoolSpec(size_bytes=tensor.size, word=word)``).

    Raises:
      TypeError: For a spec that is not attention.
      ValueError: If a stride is not a whole number of elements.

    Example (LBNHC: K and V side by side per token and head):
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=2,
      ...                                head_size=4, dtype="float32")
      >>> t = jaxkv.vllm.LayerTensor(size=2 * 4 * 1024, layers=("l0", "l1"),
      ...                       layer_stride=4096, block_stride=1024)
      >>> v = jaxkv.vllm.tensor_views(t, spec, num_blocks=4,
      ...                        layout=jaxkv.vllm.TensorLayout.LBNHC)["l1"]
      >>> v.shape, v.strides, v.byte_address((1, 2, 1, 4))  # V[0] of head 1
      ((4, 16, 2, 8), (256, 16, 8, 1), 5296)
    """  # noqa: D205
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"tensor_views: {type(spec).__name__} is not attention.")
    shape, strides = layout_strides(
        spec,
        num_blocks=num_blocks,
        num_layers=len(tensor.layers),
        layout=layout,
        kernel_block_size=kernel_block_size,
        layer_stride=tensor.layer_stride,
        block_stride=tensor.block_stride,
    )
    itemsize = np.dtype(spec.dtype).itemsize
    for name, s in zip("LBHN", strides[:4], strict=True):
        if s % itemsize:
            raise ValueError(
                f"tensor_views: the {name} stride {s} is not a multiple of the "
                f"{np.dtype(spec.dtype).name} itemsize."
            )
    _, blocks, heads, states, content = shape
    mla = isinstance(spec, MLAAttentionSpec)
    el = [s // itemsize for s in strides]
    if mla:
        view_shape = (blocks, states, content // itemsize)
        view_strides = (el[_B], el[_N], 1)
        axes = ("block", "token", "dim")
    else:
        view_shape = (blocks, states, heads, content // itemsize)
        view_strides = (el[_B], el[_N], el[_H], 1)
        axes = ("block", "token", "head", "dim")
    return {
        name: KVCacheView(
            pool=pool,
            offset=tensor.offset + i * tensor.layer_stride,
            shape=view_shape,
            strides=view_strides,
            dtype=spec.dtype,
            axes=axes,
            head_size=spec.head_size,
            word=word,
        )
        for i, name in enumerate(tensor.layers)
    }


def layout_of_view(view: KVCacheView) -> TensorLayout | None:
    """The layer-compact :class:`TensorLayout` a jaxkv attention view follows
    inside its layer (``LBNHC`` or ``LBHNC``), or ``None`` for views vLLM 0.33
    cannot describe (the seeds' K-then-V pages, K/V-first layouts).

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(), num_blocks=4)
      >>> jaxkv.vllm.layout_of_view(plan.views["layers.0.self_attn"]).name
      'LBNHC'
      >>> print(jaxkv.vllm.layout_of_view(jaxkv.make_plan(jaxkv.tiny_hybrid_config(),
      ...     num_blocks=4).views["layers.0.self_attn"]))
      None
    """  # noqa: D205
    if "kv" in view.axes or view.strides[view.dim("dim")] != 1:
        return None
    b, n = view.strides[view.block_dim], view.strides[view.dim("token")]
    if "head" not in view.axes or view.shape[view.dim("head")] == 1:
        return TensorLayout.LBNHC if b > n else None
    h = view.strides[view.dim("head")]
    if b > n > h:
        return TensorLayout.LBNHC
    if b > h > n:
        return TensorLayout.LBHNC
    return None


def plan_tensors(plan: object) -> tuple[LayerTensor, ...]:
    """A jaxkv plan's typed pools as vLLM 0.33 tensors (one per pool and
    KV-cache group), byte offsets within that pool.

    A stacked pool of ``L`` slots is one layer-compact tensor per group: the
    group's layers in slot order, ``layer_stride`` = one slot,
    ``block_stride`` = one page. Word pools (the seeds' layouts) are left out.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2),
      ...                        num_blocks=4, storage="stacked")
      >>> t, = jaxkv.vllm.plan_tensors(plan)
      >>> t.layers, t.layer_stride, t.block_stride
      (('layers.0.self_attn', 'layers.1.self_attn'), 32768, 8192)
    """  # noqa: D205
    from jaxkv.cache._plan import KVCachePlan

    if not isinstance(plan, KVCachePlan):
        raise TypeError(f"plan_tensors needs a KVCachePlan, got {type(plan).__name__}.")
    out = []
    for index, spec in enumerate(plan.pools):
        if not spec.typed:
            continue
        for group in plan.kv_cache_config.kv_cache_groups:
            layers = []
            for name in group.layer_names:
                view = plan.views.get(name)
                if isinstance(view, KVCacheView) and view.pool == index:
                    layers.append((view.layer or 0, name, view))
            seen: dict[int, tuple[str, KVCacheView]] = {}
            for slot, name, view in sorted(layers, key=lambda x: x[0]):
                seen.setdefault(slot, (name, view))
            if not seen:
                continue
            first = next(iter(seen.values()))[1]
            slot_bytes = math.prod(first.shape) * first.itemsize
            split = group.kv_cache_spec.block_size // max(first.block_size, 1)
            page = first.block_stride_bytes * max(split, 1)
            slots = sorted(seen)
            runs = (
                [slots]
                if slots == list(range(slots[0], slots[0] + len(slots)))
                else [[x] for x in slots]
            )
            for run in runs:
                out.append(
                    LayerTensor(
                        size=spec.size_bytes,
                        layers=tuple(seen[x][0] for x in run),
                        layer_stride=slot_bytes,
                        block_stride=page,
                        offset=run[0] * slot_bytes,
                    )
                )
    return tuple(out)


def allocate_layer_tensors(
    tensors: Sequence[LayerTensor],
    specs: Mapping[str, KVCacheSpec],
    *,
    num_blocks: int,
    layout: TensorLayout,
    kernel_block_sizes: Mapping[str, int] | None = None,
    word: int = 4,
) -> tuple[tuple[PoolSpec, ...], dict[str, KVCacheView]]:
    """Plans vLLM 0.33's ``allocate_kv_cache``: one backing for every tensor
    and every attention layer's view of it.

    All tensors share one backing of their (common) ``size``; tensors whose
    ranges overlap alias the same bytes, as vLLM's groups do. A layer's kernel
    block size (default: its block size) splits its blocks as a stride.
    Allocate with :func:`allocate_pools`.

    Raises:
      ValueError: If the tensors disagree on the backing size, or a layer has
        no spec.

    Example (two groups overlaying one LBNHC backing, 2 layers each):
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=2,
      ...                                head_size=8, dtype="float32")
      >>> size = 2 * 4 * spec.page_size_bytes
      >>> tensors = [jaxkv.vllm.LayerTensor(size=size, layers=names,
      ...     layer_stride=4 * spec.page_size_bytes,
      ...     block_stride=spec.page_size_bytes)
      ...     for names in (("full.0", "full.1"), ("swa.0", "swa.1"))]
      >>> pools, views = jaxkv.vllm.allocate_layer_tensors(
      ...     tensors, dict.fromkeys(["full.0", "full.1", "swa.0", "swa.1"], spec),
      ...     num_blocks=4, layout=jaxkv.vllm.TensorLayout.LBNHC)
      >>> pools[0].size_bytes, views["swa.1"].offset == views["full.1"].offset
      (16384, True)
    """  # noqa: D205
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"allocate_layer_tensors: tensors must share one backing, got sizes "
            f"{sorted(sizes)}."
        )
    views: dict[str, KVCacheView] = {}
    for tensor in tensors:
        missing = [n for n in tensor.layers if n not in specs]
        if missing:
            raise ValueError(f"allocate_layer_tensors: no spec for layers {missing}.")
        spec = specs[tensor.layers[0]]
        if not isinstance(spec, AttentionSpec):
            continue  # raw state pages: the layer lays them out itself
        k = (kernel_block_sizes or {}).get(tensor.layers[0])
        views.update(
            tensor_views(
                tensor,
                spec,
                num_blocks=num_blocks,
                layout=layout,
                kernel_block_size=k,
                word=word,
            )
        )
    return (PoolSpec(size_bytes=sizes.pop(), word=word),), views
