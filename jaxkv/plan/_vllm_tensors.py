"""vLLM 0.33's tensors over a plan: views, layouts and allocation.

vLLM 0.33's tensors over a plan: each layer's logical ``[L, B, H, N, C]`` view of
its pool, the layout a view is in, and allocation of layer tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxkv._util import check_positive_int
from jaxkv.config import AttentionSpec, KVCacheSpec, MLAAttentionSpec
from jaxkv.plan._pools import PoolSpec
from jaxkv.plan._views import KVCacheView
from jaxkv.plan._vllm_layout import LayerTensor, TensorLayout, layout_strides

_B, _H, _N = 1, 2, 3  # axes of [L, B, H, N, C]


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
    """Every layer's view of `tensor`, as vLLM's ``create_kv_cache_views``.

    Every layer's view of `tensor` in a flat word pool, as vLLM 0.33's
    ``create_kv_cache_views`` gives it: a fused K|V view in vLLM's ``[B, H,
    N, C]`` axis order, ``(blocks, H, tokens, D + Dv)`` (MLA: ``(blocks,
    tokens, D)``; a packed page: ``state`` for tokens), whose element ``(b,
    h, n, c)`` is at byte ``offset + l * layer_stride + b * s_B + h * s_H + n
    * s_N + c * itemsize``, over a pool of `word`-byte carrier words
    (``PoolSpec(size_bytes=tensor.size, word=word)``). jaxkv's reads and
    writes take it as it is (:meth:`KVCacheView.logical`).

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
      >>> v.axes, v.shape, v.strides
      (('block', 'head', 'token', 'dim'), (4, 2, 16, 8), (256, 8, 16, 1))
      >>> v.byte_address((1, 1, 2, 4))  # V[0] of head 1, token 2
      5296
    """
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
    mla = isinstance(spec, MLAAttentionSpec) and spec.num_head_slots is None
    el = [s // itemsize for s in strides]
    n_axis = "state" if spec.is_packed else "token"
    if mla:
        view_shape = (blocks, states, content // itemsize)
        view_strides = (el[_B], el[_N], 1)
        axes = ("block", n_axis, "dim")
    else:  # vLLM 0.33's [B, H, N, C]
        view_shape = (blocks, heads, states, content // itemsize)
        view_strides = (el[_B], el[_H], el[_N], 1)
        axes = ("block", "head", n_axis, "dim")
    return {
        name: KVCacheView(
            pool=pool,
            offset=tensor.offset + i * tensor.layer_stride,
            shape=view_shape,
            strides=view_strides,
            dtype=spec.dtype,
            axes=axes,
            head_size=0 if spec.is_packed else spec.head_size,
            word=word,
        )
        for i, name in enumerate(tensor.layers)
    }


def layout_of_view(view: KVCacheView) -> TensorLayout | None:
    """The layer-compact :class:`TensorLayout` a view follows, or ``None``.

    The layer-compact :class:`TensorLayout` a jaxkv attention view follows
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
    """
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
    """A jaxkv plan's typed pools as vLLM 0.33 tensors.

    One per pool and KV-cache group. Byte offsets within that pool.

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
    """
    from jaxkv.plan._plan import KVCachePlan

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
    """Plans vLLM 0.33's ``allocate_kv_cache``: one backing, every view.

    Plans vLLM 0.33's ``allocate_kv_cache``: one backing for every tensor
    and every attention layer's view of it.

    All tensors share one backing of their (common) ``size``; tensors whose
    ranges overlap alias the same bytes, as vLLM's groups do. A layer's kernel
    block size (default: its block size) splits its blocks as a stride.
    Allocate with :func:`allocate_pools`.

    Raises:
      ValueError: If `word` is not 1, 2 or 4 bytes, `num_blocks` not
        positive, the tensors disagree on the backing size, a tensor names
        no layer, a layer is named twice, a layer has no spec, or a
        tensor's geometry is impossible: a negative stride or
        offset, a layer's cache running past the backing, or two of its
        elements (of two blocks, tokens or heads of a layer, or of two of its
        layers) on one byte. Tensors may overlay each other (vLLM's groups
        share a backing); inside one tensor nothing may alias.

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
    """
    if isinstance(word, bool) or word not in (1, 2, 4):
        raise ValueError(
            "allocate_layer_tensors: word must be a pool carrier word of 1, 2 or "
            f"4 bytes (uint8/16/32), got {word!r}."
        )
    check_positive_int("allocate_layer_tensors", "num_blocks", num_blocks)
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"allocate_layer_tensors: tensors must share one backing, got sizes "
            f"{sorted(sizes)}."
        )
    views: dict[str, KVCacheView] = {}
    seen: dict[str, int] = {}
    for i, tensor in enumerate(tensors):
        if not tensor.layers:
            raise ValueError(f"allocate_layer_tensors: tensor {i} names no layer.")
        for name in tensor.layers:
            if name in seen:
                raise ValueError(
                    f"allocate_layer_tensors: layer {name!r} is in tensor "
                    f"{seen[name]} and again in tensor {i}: a layer has one cache "
                    "(its second view would silently replace the first)."
                )
            seen[name] = i
    for tensor in tensors:
        missing = [n for n in tensor.layers if n not in specs]
        if missing:
            raise ValueError(f"allocate_layer_tensors: no spec for layers {missing}.")
        spec = specs[tensor.layers[0]]
        if not isinstance(spec, AttentionSpec):
            continue  # raw state pages: the layer lays them out itself
        k = (kernel_block_sizes or {}).get(tensor.layers[0])
        own = tensor_views(
            tensor,
            spec,
            num_blocks=num_blocks,
            layout=layout,
            kernel_block_size=k,
            word=word,
        )
        _check_geometry(tensor, own)
        views.update(own)
    return (PoolSpec(size_bytes=sizes.pop(), word=word),), views


def _check_geometry(tensor: LayerTensor, views: Mapping[str, KVCacheView]) -> None:
    """Refuses a tensor whose layers' views leave the backing or alias.

    The tensor's elements are an affine map of (layer, block, token, head,
    dim) to bytes; sorted by stride, each dim's stride must step past
    everything the smaller dims cover (a nested layout: the map is then
    one-to-one), and the last element of the last layer must lie inside the
    backing.
    """
    name = tensor.layers[0]
    view = views[name]
    where = f"allocate_layer_tensors: tensor of layers {list(tensor.layers)[:4]}"
    if tensor.offset < 0 or tensor.layer_stride < 0 or tensor.block_stride < 0:
        raise ValueError(
            f"{where}: offset {tensor.offset}, layer_stride {tensor.layer_stride} "
            f"and block_stride {tensor.block_stride} must be >= 0."
        )
    item = view.itemsize
    dims = [
        (axis, n, s * item)
        for axis, n, s in zip(view.axes, view.shape, view.strides, strict=True)
    ]
    dims.append(("layer", len(tensor.layers), tensor.layer_stride))
    if any(s < 0 for _, _, s in dims):
        raise ValueError(f"{where}: a negative stride {dims}.")
    covered, inner = item, "element"
    for axis, n, stride in sorted((d for d in dims if d[1] > 1), key=lambda d: d[2]):
        if stride < covered:
            raise ValueError(
                f"{where}: its {axis} stride of {stride} bytes is smaller than the "
                f"{covered} bytes one {inner} spans, so two {axis}s share bytes "
                "(a write to one would show up in another)."
            )
        covered, inner = stride * (n - 1) + covered, axis
    for layer in tensor.layers:
        v = views[layer]
        end = v.extent_bytes
        if end > tensor.size:
            raise ValueError(
                f"{where}: layer {layer!r} ends at byte {end}, past the backing's "
                f"{tensor.size} bytes (too many blocks, or an offset or stride "
                "past the tensor)."
            )
