"""Decode rows of :func:`paged_attention` on the native XLA:CPU kernel.

Rows of one query token whose keys are a contiguous range (causal, sliding
window, local chunk, cross-attention; not PrefixLM) over float32 or bfloat16
K/V are handed to ``jaxkv/_native/paged_decode.cc`` as one FFI custom call:
the key range of each row is computed here from the step's metadata, exactly
as :func:`jaxkv._attention_rows.visible` masks it, and the kernel reads the
pages in place through the view's byte offset and element strides, whatever
the pool array's type (typed elements, their bits, or carrier words: the
bytes are the same, so nothing is converted or copied).

XLA's SPMD partitioner cannot split a custom call, so a sharded pool would be
gathered whole: ``contraction="auto"`` takes this path only in a process
with one device, on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._attention_rows import Mask, query_rows_of, value_dim
from jaxkv._native import target
from jaxkv.cache import KVCacheView, Pools, layer_index, raw_address, raw_unfit
from jaxkv.step import CommonAttentionMetadata

_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def native_unfit(view: KVCacheView, opts: Mask, query_tile: int) -> str | None:
    """Why the native kernel cannot run this call (``None``: it can).

    Example:
      >>> import jaxkv
      >>> from jaxkv._attention_rows import Mask
      >>> from jaxkv._attention_native import native_unfit
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> view = plan.views["layers.0.self_attn"]
      >>> opts = Mask(True, None, None, False, False)
      >>> native_unfit(view, opts, 16)
      'rows of 16 query tokens (the kernel takes rows of 1)'
    """
    if query_tile != 1:
        return f"rows of {query_tile} query tokens (the kernel takes rows of 1)"
    if opts.use_mm_prefix:
        return "use_mm_prefix=True (PrefixLM ranges)"
    reason = raw_unfit(view)
    if reason is not None:
        return reason
    if view.dtype not in _DTYPES:
        return f"dtype {view.dtype} (the kernel reads float32 and bfloat16)"
    if jax.default_backend() != "cpu":
        return f"the {jax.default_backend()} backend (the kernel runs on XLA:CPU only)"
    return None


def key_bounds(
    meta: CommonAttentionMetadata, num_tokens: int, opts: Mask, width: int
) -> tuple[jax.Array, jax.Array]:
    """``(table (T, width), bounds (T, 2))``: each token's pages, keys ``[lo, hi)``."""
    rows = query_rows_of(meta, num_tokens, 1, opts, width)
    valid = rows.valid[:, 0]
    pos = rows.pos[:, 0]
    hi = rows.kv_len
    lo = jnp.zeros_like(hi)
    if not opts.cross_attention:
        if opts.causal:
            own = jnp.minimum(hi, pos + 1)
            hi = jnp.where(meta.request_causal[rows.req], own, hi)
        if opts.sliding_window is not None:
            lo = jnp.maximum(lo, pos - opts.sliding_window + 1)
        if opts.attention_chunk_size is not None:
            size = opts.attention_chunk_size
            lo = jnp.maximum(lo, pos // size * size)
            hi = jnp.minimum(hi, (pos // size + 1) * size)
    hi = jnp.where(valid, hi, 0)
    lo = jnp.where(valid, jnp.maximum(lo, 0), 0)
    bounds = jnp.stack([lo, hi], axis=1).astype(jnp.int32)
    return rows.table.astype(jnp.int32), bounds


def native_decode(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: object,
    *,
    opts: Mask,
    scale: float,
    logits_soft_cap: float | None,
) -> jax.Array:
    """``(T, H, Dv)`` attention of rows of one token, on the native kernel."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = view.shape[view.dim("head")]
    table, bounds = key_bounds(meta, num_tokens, opts, meta.block_table_tensor.shape[1])
    head_dim_v = value_dim(view, head_dim)
    call = jax.ffi.ffi_call(
        target(),
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim_v), jnp.float32),
        vmap_method="sequential",
    )
    out = call(
        q.astype(jnp.float32),
        pools[view.pool],
        table,
        bounds,
        layer_index(layer, view) if view.typed else jnp.int32(0),
        **raw_address(view),
        kv_heads=np.int64(kv_heads),
        head_dim_v=np.int64(head_dim_v),
        scale=np.float32(scale),
        soft_cap=np.float32(logits_soft_cap or 0.0),
    )
    return out.astype(q.dtype)
