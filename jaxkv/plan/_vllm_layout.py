"""vLLM 0.33's description of KV-cache storage: permutations of ``[L, B, H, N, C]``.

vLLM 0.33 allocates one backing buffer and places every set of
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
from collections.abc import Iterable, Sequence

from jaxkv.config import AttentionSpec, KVCacheSpec, MambaSpec

_L, _B, _H, _N, _C = range(5)


class TensorLayout(enum.Enum):
    """A physical order of the logical ``[L, B, H, N, C]`` axes.

    VLLM 0.33's ``KVCacheLayout``. The value is the stride order, outermost first.

    Example:
      >>> import jaxkv
      >>> lay = jaxkv.vllm.TensorLayout.LBNHC  # vLLM 0.33's default (FlashAttention)
      >>> lay.is_layer_compact, lay.is_block_compact, lay.is_block_outermost
      (True, True, False)
    """

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
    itemsize``; Mamba: one state of all its bytes. vLLM's packing fields
    (:class:`AttentionSpec`) give ``H = num_head_slots``, ``N = k /
    tokens_per_state``, ``C = state_content_bytes``.

    Raises:
      TypeError: For a spec with no per-layer view in vLLM 0.33's model.

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8,
      ...                                head_size=128, dtype="bfloat16")
      >>> jaxkv.vllm.hnc_shape(spec), jaxkv.vllm.hnc_shape(spec, kernel_block_size=8)
      ((8, 16, 512), (8, 8, 512))
      >>> packed = jaxkv.MLAAttentionSpec(block_size=256, num_kv_heads=1,
      ...     head_size=512, dtype="uint8", state_content_bytes=528,
      ...     tokens_per_state=4)
      >>> jaxkv.vllm.hnc_shape(packed)
      (1, 64, 528)
    """
    if isinstance(spec, MambaSpec):
        return 1, 1, spec.real_page_size_bytes
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"{type(spec).__name__} has no [L, B, H, N, C] view.")
    k = spec.view_block_size(kernel_block_size)
    states = spec.states_in(k)
    if states is None:
        raise ValueError(
            f"kernel_block_size={k} does not divide the block size {spec.block_size} "
            f"into blocks of whole states (tokens_per_state={spec.tokens_per_state})."
        )
    return spec.num_heads, states, spec.state_content_size_bytes


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
    ratio = (
        spec.block_size // spec.view_block_size(kernel_block_size)
        if isinstance(spec, AttentionSpec)
        else 1
    )
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
