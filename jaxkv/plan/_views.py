"""Per-layer views of shared pools: static index maps, never copies (spec §1.7, §1.8).

A view says where each logical element of a layer's cache lives in its pool:
``byte(idx) = offset + sum(idx[d] * strides[d]) * itemsize``. It is a frozen,
hashable, leafless pytree, so it can be a jit static argument. The pools are
the single source of truth; every read and write goes through a view.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jaxkv.config import AttentionBackend, KVCacheLayout

# Role of each logical axis, per layout.
_AXES = {
    KVCacheLayout.BLOCKS_FIRST: ("block", "kv", "token", "head", "dim"),
    KVCacheLayout.KV_FIRST: ("kv", "block", "token", "head", "dim"),
    KVCacheLayout.BLOCKS_FIRST_FUSED: ("block", "token", "head", "dim"),
    KVCacheLayout.MLA: ("block", "token", "dim"),
}


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheView:
    """A strided view of one pool: offset, logical shape, element strides, dtype.

    Args:
      pool: Index of the pool (in the tuple :func:`init_kv_cache` returns).
      offset: Byte offset of element 0 from the pool's start.
      shape: Logical shape (the backend's shape rule, or ``(N, *state)``).
      strides: Element strides of each logical dim.
      dtype: Element dtype.
      axes: Role of each logical dim: ``block``, ``kv``, ``token``, ``head``,
        ``dim`` or ``state``.
      head_size: Key head size ``D``: where a fused K|V last dim splits.
      word: Byte width of the pool's carrier word (set when pools are planned).
      owned: ``(s, r)`` for a kernel view of a packed pool (spec §1.8): of every
        ``s`` consecutive block ids only the first ``r`` are this layer's pages
        (the others address other layers' bytes); ``None``: every id is owned.
      layer: The layer slot of a typed pool (``None``: a flat word pool). A
        typed pool holds ``L`` slots of ``prod(shape)`` elements; this view is
        dense over slot `layer`, and `offset` is that slot's first byte
        (``layer * slot bytes``).
      kv_packing: ``p`` for a backend that packs K/V heads
        (:attr:`AttentionBackend.packs_kv_heads`): a typed pool's slot is
        then ``(N, B, 2H/p, p, D)``; ``None`` otherwise.
      windowed: Set by :func:`bind_kv_caches` when a layer bound to the view
        has a sliding window or local chunk: :func:`paged_attention` then
        refuses the bare view unless given the window (pass the layer's
        :class:`AttentionLayer`, ``plan.attention_layer(name)``).
      stacked: Set by :meth:`KVCachePlan.layer_stack` on its layer's view,
        which stands for every layer of the stack: each read, write and
        :func:`paged_attention` through it must name the slot (``layer=``);
        without it, one call would address the first layer while another
        addresses the traced one.
      groups: Set by :func:`bind_kv_caches`: the KV-cache groups whose layers
        are bound to the view (a KV-sharing layer counts its target's).
        :func:`write_kv` and :func:`paged_attention` refuse, through the bare
        view, a metadata record of another group (its block tables and slots
        address other pages); ``()``: unbound, nothing to check. Not part of
        equality or the hash: views of the same bytes stay equal.
      kv_quant_mode: The spec's ``kv_quant_mode`` (``"none"``: the pages hold
        the values). Quantized pages are written and read by XLA's path,
        which quantizes and dequantizes (:mod:`jaxkv.kv._quant`).

    Example:
      >>> import jaxkv
      >>> view = jaxkv.KVCacheView(pool=0, offset=0, shape=(10, 2, 16, 8, 128),
      ...     strides=(32768, 16384, 1024, 128, 1), dtype="bfloat16",
      ...     axes=("block", "kv", "token", "head", "dim"))
      >>> view.byte_address((3, 1, 5, 2, 7)), view.num_blocks, view.block_size
      (240142, 10, 16)
    """

    pool: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: Any
    axes: tuple[str, ...]
    head_size: int = 0
    word: int = 1
    owned: tuple[int, int] | None = None
    layer: int | None = None
    kv_packing: int | None = None
    windowed: bool = False
    stacked: bool = False
    groups: tuple[int, ...] = dataclasses.field(default=(), compare=False)
    kv_quant_mode: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(jax.numpy.dtype(self.dtype)))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        if not (len(self.shape) == len(self.strides) == len(self.axes)):
            raise ValueError(
                f"KVCacheView shape {self.shape}, strides {self.strides} and axes "
                f"{self.axes} must have the same length."
            )
        if "block" not in self.axes:
            raise ValueError(f"KVCacheView axes {self.axes} have no 'block' axis.")

    def logical(self) -> KVCacheView:
        """The same bytes with the axes in jaxkv's logical order.

        ``(..., token, head, dim)`` (a packed page's ``state`` in place of
        ``token``); a view in vLLM 0.33's ``[B, H, N, C]`` order
        (:func:`jaxkv.vllm.tensor_views`) names heads first. This swaps the
        two axes, their sizes and strides: no byte moves. Writes, the Pallas
        kernels and the native kernel address a view by axis name; the one
        read that returns pages by position, :func:`gather_kv_pages` (XLA's
        attention path), calls this first.

        Example:
          >>> import jaxkv
          >>> v = jaxkv.KVCacheView(pool=0, offset=0, shape=(4, 2, 16, 8),
          ...     strides=(256, 128, 8, 1), dtype="float32",
          ...     axes=("block", "head", "token", "dim"))
          >>> w = v.logical()
          >>> w.axes, w.shape, w.strides
          (('block', 'token', 'head', 'dim'), (4, 16, 2, 8), (256, 8, 128, 1))
          >>> v.byte_address((1, 1, 3, 2)) == w.byte_address((1, 3, 1, 2))
          True
        """
        n = "token" if "token" in self.axes else "state"
        if n not in self.axes or "head" not in self.axes:
            return self
        t, h = self.axes.index(n), self.axes.index("head")
        if t < h:
            return self
        order = list(range(len(self.axes)))
        order[t], order[h] = h, t
        return dataclasses.replace(
            self,
            shape=tuple(self.shape[i] for i in order),
            strides=tuple(self.strides[i] for i in order),
            axes=tuple(self.axes[i] for i in order),
        )

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def typed(self) -> bool:
        """Whether the view reads a typed pool (an element array, not words)."""
        return self.layer is not None

    @property
    def nbytes(self) -> int:
        """Bytes of every element the view addresses."""
        return math.prod(self.shape) * self.itemsize

    def dim(self, role: str) -> int:
        """Index of the logical dim playing `role`."""
        return self.axes.index(role)

    @property
    def block_dim(self) -> int:
        """Index of the block axis."""
        return self.dim("block")

    @property
    def num_blocks(self) -> int:
        """Addressable block ids."""
        return self.shape[self.block_dim]

    def owns(self, block_ids: Any) -> Any:
        """Whether each of `block_ids` is one of this view's own blocks.

        In range, and not another layer's page of a packed pool. NumPy or JAX.
        """
        xp = np if isinstance(block_ids, np.ndarray | int | np.integer) else jax.numpy
        ok = (block_ids >= 0) & (block_ids < self.num_blocks)
        if self.owned is not None:
            stride, pieces = self.owned
            ok = ok & (xp.remainder(block_ids, stride) < pieces)
        return ok

    @property
    def block_size(self) -> int:
        """Tokens per block (0 for state views)."""
        return self.shape[self.dim("token")] if "token" in self.axes else 0

    @property
    def extent_bytes(self) -> int:
        """One past the last byte the view addresses in its pool."""
        last = sum((n - 1) * st for n, st in zip(self.shape, self.strides, strict=True))
        return self.offset + (last + 1) * self.itemsize

    @property
    def block_stride_bytes(self) -> int:
        """Bytes between consecutive block ids."""
        return self.strides[self.block_dim] * self.itemsize

    def byte_address(self, index: tuple[int, ...]) -> int:
        """Byte address of the element at logical `index`."""
        return (
            self.offset
            + sum(i * s for i, s in zip(index, self.strides, strict=True))
            * self.itemsize
        )

    def block_byte_set(self, block: int) -> np.ndarray:
        """Sorted byte addresses owned by `block` (host-side, for checks and tests)."""
        others = [range(n) for d, n in enumerate(self.shape) if d != self.block_dim]
        grids = np.meshgrid(*[np.arange(len(r)) for r in others], indexing="ij")
        rest = [d for d in range(len(self.shape)) if d != self.block_dim]
        elem = sum(
            (
                g.ravel().astype(np.int64) * self.strides[d]
                for g, d in zip(grids, rest, strict=True)
            ),
            start=np.zeros(1, np.int64),
        )
        starts = (
            self.offset + (elem + block * self.strides[self.block_dim]) * self.itemsize
        )
        return np.unique((starts[:, None] + np.arange(self.itemsize)).ravel())


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class MambaView:
    """A Mamba layer's per-state views: state ``i`` is ``(N, *shapes[i])``.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> views = jaxkv.plan.build_kv_cache_views(kv, cfg, sizes, groups)
      >>> [s.shape for s in views["layers.2.mixer"].states]
      [(4, 3, 128), (4, 4, 32, 16)]
    """

    states: tuple[KVCacheView, ...]

    @property
    def pool(self) -> int:
        """Index of the pool."""
        return self.states[0].pool

    @property
    def num_blocks(self) -> int:
        """Addressable block ids."""
        return self.states[0].num_blocks

    def block_byte_set(self, block: int) -> np.ndarray:
        """Sorted byte addresses owned by `block` across all states."""
        return np.unique(np.concatenate([s.block_byte_set(block) for s in self.states]))


LayerView = KVCacheView | MambaView
"""A layer's view of the pools: K/V pages or Mamba states."""


def dense_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> list[int]:
    """Element strides making `shape` row-major contiguous in physical `order`."""
    strides = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d]
    return strides


def attention_view(
    backend: AttentionBackend,
    *,
    pool: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    dtype: np.dtype,
    cache_dtype: str,
    block_stride: int | None,
    kv_quant_mode: str = "none",
    offset: int = 0,
) -> KVCacheView:
    """A view of one attention layer.

    Args:
      backend: Gives the logical shape, stride order and block dim.
      pool: Pool index.
      num_blocks: Blocks viewed (kernel blocks when split).
      block_size: Tokens per viewed block.
      num_kv_heads: ``H``.
      head_size: ``D``.
      head_size_v: ``Dv``.
      dtype: Element dtype.
      cache_dtype: Cache dtype name given to the shape rule.
      kv_quant_mode: The spec's quantization mode, carried by the view.
      block_stride: Bytes between blocks with the block axis made physically
        outermost (V1 and page-aligned V3); ``None`` for the dense K/V-first
        form (V2), where the whole layer is one dense array.
      offset: Byte offset of block 0.

    Returns:
      The view.
    """
    shape = backend.get_kv_cache_shape(
        num_blocks,
        block_size,
        num_kv_heads,
        head_size,
        cache_dtype,
        head_size_v=head_size_v,
    )
    axes = _AXES[backend.layout]
    order = backend.get_kv_cache_stride_order()
    bd = axes.index("block")
    if block_stride is None:
        strides = dense_strides(shape, order)
    else:
        itemsize = np.dtype(dtype).itemsize
        if block_stride % itemsize:
            raise ValueError(
                f"Block stride {block_stride} bytes is not a multiple of the "
                f"{np.dtype(dtype).name} itemsize."
            )
        inner = tuple(d for d in order if d != bd)
        strides = dense_strides(shape, (bd, *inner))
        strides[bd] = block_stride // itemsize
    if offset % np.dtype(dtype).itemsize:
        raise ValueError(f"Byte offset {offset} is not a multiple of the itemsize.")
    packing = None
    if backend.packs_kv_heads and backend.layout == KVCacheLayout.BLOCKS_FIRST_FUSED:
        p = max(1, 4 // np.dtype(dtype).itemsize)
        if head_size_v == head_size and (2 * num_kv_heads) % p == 0:
            packing = p
    return KVCacheView(
        pool=pool,
        offset=offset,
        shape=shape,
        strides=tuple(strides),
        dtype=dtype,
        axes=axes,
        head_size=head_size,
        kv_packing=packing,
        kv_quant_mode=kv_quant_mode,
    )


def restride_blocks_first_to_kv_first(view: KVCacheView) -> KVCacheView:
    """V4: re-address a blocks-first view onto K/V-first storage (spec §1.7, §2.13).

    Block ``q``'s K part moves to ``q*U_k/2`` and its V part to
    ``Nk*U_k/2 + q*U_k/2``.

    Raises:
      ValueError: If the view has no explicit K/V axis at dim 1.
    """
    if view.axes[:2] != ("block", "kv") or view.shape[1] != 2:
        raise ValueError(
            f"Cannot restride a blocks-first view with axes {view.axes} and shape "
            f"{view.shape} onto K/V-first storage: it needs a K/V axis of size 2 at "
            "dim 1 (a fused K|V layout cannot share a pool with a K/V-first layer)."
        )
    half = math.prod(view.shape[2:])
    strides = (half, view.shape[0] * half, *view.strides[2:])
    return dataclasses.replace(view, strides=strides)
