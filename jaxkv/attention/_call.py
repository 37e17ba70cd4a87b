"""The contract every attention implementation meets.

One call's static options, the rows it attends, and where a kernel finds a layer's pages
in its pool.

Each implementation (``_xla``, ``_native``, ``_pallas_gpu``, ``_pallas_tpu``)
is a function ``(q, pools, view, meta, layer, call) -> (T, H, Dv)`` with the
same result up to float rounding: zero for padded tokens, keys past the
request's length, the block table's end or the query's mask never seen, and
NaN in pages or slots nobody may see never reaching an output.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxkv.attention._rows import Mask, Rows, key_ranges, query_rows_of, value_dim
from jaxkv.kv import PageLayout, Pools, layer_index, page_layout, pallas_view_unfit
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata


class Call(NamedTuple):
    """The static options of one :func:`paged_attention` call (hashable)."""

    mask: Mask
    scale: float
    logits_soft_cap: float | None
    pages_per_chunk: int | None
    query_tile: int
    contraction: str
    # fp8_per_tensor pages' static scales: one per tensor, or one per KV head.
    k_scale: float | tuple[float, ...] | None = None
    v_scale: float | tuple[float, ...] | None = None


def scalar_scale(scale: float | tuple[float, ...] | None) -> float:
    """A per-tensor static scale as a float (1.0 when none).

    For kernels that fold one scalar into their math; scales per head are
    refused before (:func:`per_head_scales_unfit`).

    Raises:
      ValueError: For scales per head.
    """
    if isinstance(scale, tuple):
        raise ValueError(
            "static scales per KV head: this kernel folds one scalar; XLA's "
            "path applies them."
        )
    return 1.0 if scale is None else scale


def per_head_scales_unfit(call: Call) -> str | None:
    """Why a kernel folding scalar scales cannot take this call (``None``: it can)."""
    if isinstance(call.k_scale, tuple) or isinstance(call.v_scale, tuple):
        return "static scales per KV head (XLA's path applies them)"
    return None


def kv_heads_of(view: KVCacheView) -> int:
    """KV heads of an attention view (1 for MLA latents)."""
    return view.shape[view.dim("head")] if "head" in view.axes else 1


def pallas_unfit(
    view: KVCacheView, call: Call, *, fp8_per_tensor: bool = False
) -> str | None:
    """Why jaxkv's Pallas attention kernels cannot take this call (or ``None``).

    Why jaxkv's Pallas attention kernels cannot take this call (``None``:
    they can): the view's reasons (:func:`jaxkv.kv.pallas_view_unfit`),
    or PrefixLM ranges (the kernels walk one contiguous key range per query).

    Example:
      >>> import jaxkv
      >>> from jaxkv.attention._call import Call, pallas_unfit
      >>> from jaxkv.attention._rows import Mask
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2),
      ...                        num_blocks=4, storage="stacked")
      >>> view = plan.views["layers.0.self_attn"]
      >>> mask = Mask(True, None, None, False, True)
      >>> pallas_unfit(view, Call(mask, 1.0, None, None, 1, "auto"))
      'use_mm_prefix=True (PrefixLM ranges are not one key range)'
    """
    reason = pallas_view_unfit(view, fp8_per_tensor=fp8_per_tensor)
    if reason is not None:
        return reason
    reason = per_head_scales_unfit(call)
    if reason is not None:
        return reason
    if call.mask.use_mm_prefix:
        return "use_mm_prefix=True (PrefixLM ranges are not one key range)"
    return None


class RowPlan(NamedTuple):
    """A step's query rows as a page-walking kernel takes them.

    ``info (R, 4)``: each row's request, first token, first and end page
    column (``[first, end)`` holds every key some query of the row sees);
    ``bounds (R, tile, 2)``: each query slot's key range ``[lo, hi)`` (empty
    for empty slots); ``rows``: the rows themselves.
    """

    info: jax.Array
    bounds: jax.Array
    rows: Rows


def row_plan(
    meta: CommonAttentionMetadata,
    num_tokens: int,
    tile: int,
    mask: Mask,
    block_size: int,
) -> RowPlan:
    """The rows of `tile` query tokens and the pages each must walk."""
    cols = meta.block_table_tensor.shape[1]
    rows = query_rows_of(meta, num_tokens, tile, mask, cols, block_size=block_size)
    lo, hi = key_ranges(rows, meta, mask)
    some = hi > lo
    live = jnp.any(some, axis=1)
    big = jnp.iinfo(jnp.int32).max
    first = jnp.min(jnp.where(some, lo, big), axis=1) // block_size
    end = (jnp.max(jnp.where(some, hi, 0), axis=1) + block_size - 1) // block_size
    first = jnp.where(live, first, 0)
    end = jnp.where(live, jnp.minimum(end, cols), 0)
    start = jnp.where(rows.valid[:, 0], rows.tok[:, 0], 0)
    info = jnp.stack([rows.req, start, first, end], axis=1).astype(jnp.int32)
    bounds = jnp.stack([lo, hi], axis=-1).astype(jnp.int32)
    return RowPlan(info, bounds, rows)


def rows_to_tokens(
    rows_out: jax.Array, rows: Rows, num_tokens: int, dtype: jnp.dtype
) -> jax.Array:
    """``(R, tile, H, Dv)`` row outputs as ``(T, H, Dv)`` token outputs."""
    tile = rows.tok.shape[1]
    if tile == 1 and rows_out.shape[0] == num_tokens:  # rows are the tokens
        return rows_out[:, 0].astype(dtype)
    _, _, heads, dv = rows_out.shape
    out = jnp.zeros((num_tokens, heads, dv), rows_out.dtype)
    tok = jnp.where(rows.valid, rows.tok, num_tokens)
    return out.at[tok].set(rows_out, mode="drop").astype(dtype)


class KernelCall(NamedTuple):
    """What a page-walking kernel needs of one call, derived once.

    The query shape (GQA group), head dims, the rows and their pages, and the pool as
    ``(L, *physical shape)`` (a bitcast) with its :class:`PageLayout`.
    """

    num_tokens: int
    heads: int
    kv_heads: int
    groups: int  # query heads per KV head
    dk: int
    dv: int
    tile: int
    plan: RowPlan
    lay: PageLayout
    slots: jax.Array


def kernel_call(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    call: Call,
) -> KernelCall:
    """The :class:`KernelCall` of one attention call."""
    num_tokens, heads, head_dim = q.shape
    kvh = kv_heads_of(view)
    dk, dv = head_dims(view, head_dim)
    pool = pools[view.pool]
    lay = page_layout(view, pool)
    return KernelCall(
        num_tokens=num_tokens,
        heads=heads,
        kv_heads=kvh,
        groups=heads // kvh,
        dk=dk,
        dv=dv,
        tile=call.query_tile,
        plan=row_plan(meta, num_tokens, call.query_tile, call.mask, view.block_size),
        lay=lay,
        slots=pool.reshape(lay.slots_shape),
    )


def layer_of(layer: object, view: KVCacheView) -> jax.Array:
    """``(1,)`` int32 layer slot (traced or the view's own)."""
    return layer_index(layer, view).reshape(1)


def head_dims(view: KVCacheView, head_dim: int) -> tuple[int, int]:
    """``(Dk, Dv)`` of a view read with queries of `head_dim`."""
    return head_dim, value_dim(view, head_dim)
