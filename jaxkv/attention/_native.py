"""Decode rows of :func:`paged_attention` on the native XLA:CPU kernel.

Rows of one query token whose keys are a contiguous range (causal, sliding
window, local chunk, cross-attention; not PrefixLM) over float32, bfloat16 or
8-bit K/V are handed to ``jaxkv/_native/paged_decode.cc`` as one FFI custom call:
the key range of each row is computed here from the step's metadata, exactly
as :func:`jaxkv.attention._rows.visible` masks it, and the kernel reads the
pages in place through the view's byte offset and element strides, whatever
the pool array's type (typed elements, their bits, or carrier words: the
bytes are the same, so nothing is converted or copied).

XLA's SPMD partitioner cannot split a custom call, so a sharded pool would be
gathered whole: call it on one device, or per device inside ``shard_map``.
It runs only when asked for (``implementation="native"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._native import target
from jaxkv.attention._call import Call, per_head_scales_unfit, scalar_scale
from jaxkv.attention._rows import key_ranges, query_rows_of, value_dim
from jaxkv.kv import Pools, layer_index, raw_address, raw_unfit, raw_views
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata

# The page dtypes the kernel reads, by its element_kind attribute.
_KINDS = {
    np.dtype(np.float32): 0,
    np.dtype(jnp.bfloat16): 1,
    np.dtype(np.int8): 2,
    np.dtype(jnp.float8_e4m3fn): 3,
    np.dtype(jnp.float8_e5m2): 4,
}
_FLOATS = tuple(list(_KINDS)[:2])


def native_unfit(view: KVCacheView, call: Call) -> str | None:
    """Why the native kernel cannot run this call (``None``: it can).

    Example:
      >>> import jaxkv
      >>> from jaxkv.attention._call import Call
      >>> from jaxkv.attention._rows import Mask
      >>> from jaxkv.attention._native import native_unfit
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> view = plan.views["layers.0.self_attn"]
      >>> mask = Mask(True, None, None, False, False)
      >>> native_unfit(view, Call(mask, 1.0, None, None, 16, "auto"))
      'rows of 16 query tokens (the kernel takes rows of 1)'
    """
    if call.query_tile != 1:
        return f"rows of {call.query_tile} query tokens (the kernel takes rows of 1)"
    if call.mask.use_mm_prefix:
        return "use_mm_prefix=True (PrefixLM ranges)"
    if per_head_scales_unfit(call) is not None:
        return per_head_scales_unfit(call)
    if view.kv_quant_mode != "none":
        try:
            plain = raw_views(view)[0]
        except (ValueError, NotImplementedError) as e:
            return f"{view.kv_quant_mode} pages the kernel cannot address: {e}"
        return raw_unfit(plain)
    reason = raw_unfit(view)
    if reason is not None:
        return reason
    if view.dtype not in _FLOATS:
        return (
            f"dtype {view.dtype} (the kernel reads float32 and bfloat16, and "
            "8-bit pages of a kv_quant_mode)"
        )
    return None


def native_attention(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: object,
    call: Call,
) -> jax.Array:
    """``(T, H, Dv)`` attention of rows of one token, on the native kernel."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = view.shape[view.dim("head")]
    cols = meta.block_table_tensor.shape[1]
    rows = query_rows_of(
        meta, num_tokens, 1, call.mask, cols, block_size=view.block_size
    )
    lo, hi = key_ranges(rows, meta, call.mask)
    bounds = jnp.stack([lo[:, 0], hi[:, 0]], axis=1)
    head_dim_v = value_dim(view, head_dim)
    plain, *token_scales = raw_views(view)
    scale = call.scale * scalar_scale(call.k_scale)
    scales = {
        "scale_byte_offset": np.int64(-1),
        "scale_extent_bytes": np.int64(0),
        "scale_block_stride": np.int64(0),
        "scale_token_stride": np.int64(0),
        "scale_head_stride": np.int64(0),
        "scale_v_offset": np.int64(0),
    }
    if token_scales:  # per token and head: the page's own scale region
        where = raw_address(token_scales[0])
        scales.update(
            scale_byte_offset=where["byte_offset"],
            scale_extent_bytes=where["extent_bytes"],
            scale_block_stride=where["block_stride"],
            scale_token_stride=where["token_stride"],
            scale_head_stride=where["head_stride"],
            scale_v_offset=where["v_offset"],
        )
    call_ffi = jax.ffi.ffi_call(
        target(),
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim_v), jnp.float32),
        vmap_method="sequential",
    )
    out = call_ffi(
        q.astype(jnp.float32),
        pools[view.pool],
        rows.table.astype(jnp.int32),
        bounds,
        layer_index(layer, view) if view.typed else jnp.int32(0),
        **raw_address(plain),
        kv_heads=np.int64(kv_heads),
        head_dim_v=np.int64(head_dim_v),
        scale=np.float32(scale),
        soft_cap=np.float32(call.logits_soft_cap or 0.0),
        element_kind=np.int64(_KINDS[plain.dtype]),
        v_scale=np.float32(scalar_scale(call.v_scale)),
        **scales,
    )
    return out.astype(q.dtype)
