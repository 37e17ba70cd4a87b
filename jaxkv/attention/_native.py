"""Decode rows of :func:`paged_attention` on the native XLA:CPU kernel.

Rows of one query token whose keys are a contiguous range (causal, sliding
window, local chunk, cross-attention; not PrefixLM) over float32 or bfloat16
K/V are handed to ``jaxkv/_native/paged_decode.cc`` as one FFI custom call:
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
from jaxkv.attention._call import Call
from jaxkv.attention._rows import key_ranges, query_rows_of, value_dim
from jaxkv.kv import Pools, layer_index, raw_address, raw_unfit
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata

_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


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
    reason = raw_unfit(view)
    if reason is not None:
        return reason
    if view.dtype not in _DTYPES:
        return f"dtype {view.dtype} (the kernel reads float32 and bfloat16)"
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
        **raw_address(view),
        kv_heads=np.int64(kv_heads),
        head_dim_v=np.int64(head_dim_v),
        scale=np.float32(call.scale),
        soft_cap=np.float32(call.logits_soft_cap or 0.0),
    )
    return out.astype(q.dtype)
