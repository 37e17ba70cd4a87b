"""Where a kernel that reads raw bytes finds a view's K and V in its pool."""

from __future__ import annotations

import math

import numpy as np

from jaxkv.kv._quant import quant_unfit
from jaxkv.plan import KVCacheView


def raw_unfit(view: KVCacheView) -> str | None:
    """Why a raw-byte kernel cannot take `view` (``None``: it can).

    It needs block, token, head and dim axes with the dim contiguous, and a view that
    owns every page it addresses (a kernel view of a packed pool addresses other layers'
    pages too; a head-packing backend interleaves heads).

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> jaxkv.kv.raw_unfit(plan.views["layers.0.self_attn"]) is None
      True
    """
    if quant_unfit(view):
        return quant_unfit(view)
    if view.owned is not None or view.kv_packing:
        return "a kernel view of a packed pool or a head-packing backend"
    if not {"block", "token", "head", "dim"} <= set(view.axes):
        return f"view axes {view.axes} (needs block, token, head and dim)"
    if view.strides[view.dim("dim")] != 1:
        return "a head dim that is not contiguous"
    return None


def raw_address(view: KVCacheView) -> dict[str, np.int64]:
    """The byte offset and element strides of a K/V view in its pool array.

    A native kernel handed ``pools[view.pool]`` (any array type: typed
    elements, their bits, or carrier words; the bytes are the same) finds
    element ``(block b, token j, head h, dim d)`` of K at byte
    ``byte_offset + layer * slot_bytes + (b * block_stride + j * token_stride
    + h * head_stride + d) * element_bytes``, and V ``v_offset`` elements
    after it. ``slot_bytes`` is one layer slot of a typed pool (0 for a word
    pool, whose view sits at ``byte_offset``); ``extent_bytes`` spans the
    view's first to last element, for a kernel's bounds check. These are
    the attributes jaxkv's own XLA:CPU kernels take (``jaxkv/_native``).

    Args:
      view: A K/V view a raw kernel can take (:func:`raw_unfit`).

    Returns:
      ``{block_stride, token_stride, head_stride, v_offset, byte_offset,
      slot_bytes, element_bytes, extent_bytes, num_blocks, block_size}``,
      each an ``np.int64`` (FFI attributes).

    Raises:
      ValueError: For a view :func:`raw_unfit` names a reason for.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> a = jaxkv.kv.raw_address(plan.views["layers.0.self_attn"])
      >>> int(a["token_stride"]), int(a["head_stride"]), int(a["v_offset"])
      (64, 32, 2048)
    """
    reason = raw_unfit(view)
    if reason is not None:
        raise ValueError(f"raw_address: cannot address this view: {reason}.")
    itemsize = view.dtype.itemsize
    extent = 1 + sum(
        (n - 1) * st for n, st in zip(view.shape, view.strides, strict=True)
    )
    v_offset = view.strides[view.dim("kv")] if "kv" in view.axes else view.head_size
    return {
        "block_stride": np.int64(view.strides[view.block_dim]),
        "token_stride": np.int64(view.strides[view.dim("token")]),
        "head_stride": np.int64(view.strides[view.dim("head")]),
        "v_offset": np.int64(v_offset),
        "byte_offset": np.int64(0 if view.typed else view.offset),
        "slot_bytes": np.int64(math.prod(view.shape) * itemsize if view.typed else 0),
        "element_bytes": np.int64(itemsize),
        "extent_bytes": np.int64(extent * itemsize),
        "num_blocks": np.int64(view.num_blocks),
        "block_size": np.int64(view.block_size),
    }
