"""Paged attention as a Mosaic TPU Pallas kernel.

The grid is (query row, page step). Each row's request, first and end page
column, and the block table ride in SMEM as scalar prefetch, so the
pipeline's index map reads a row's next page id from the table and Pallas
DMAs exactly that page of the layer's slot from HBM into VMEM, double
buffered, while the current page is being used: the pool itself is never
copied, converted or sliced outside the kernel. The design follows jax's
``jax.experimental.pallas.ops.tpu.paged_attention`` (scalar-prefetched
block tables driving the K/V BlockSpecs, an online softmax kept in VMEM
scratch across the sequential page axis), made ragged as tpu-inference's
ragged paged attention is: rows are up to ``query_tile`` consecutive query
tokens of one request, and a row's page steps past its last visible page
re-point at that page (same block index: no new DMA) and skip the compute.

A page is loaded with all of its KV heads (its last two dims are then whole,
as Mosaic's (8, 128) tiling asks); each KV head's ``tile * G`` query rows
(GQA) meet it as one matmul. The layer slot may be traced (``lax.scan``
over a stack). On CPU the kernel runs in the TPU interpret mode
(``pltpu.InterpretParams``), which simulates its DMAs and SMEM: that is how
CI checks it against XLA's path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv._util import kernel_operands
from jaxkv.attention._call import (
    Call,
    kernel_call,
    layer_of,
    pallas_unfit,
    rows_to_tokens,
)
from jaxkv.kv import PageLayout, Pools
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata

_MASKED = -1e30


def tpu_unfit(view: KVCacheView, call: Call, q_shape: tuple[int, ...]) -> str | None:
    """Why the TPU kernel cannot take this call (``None``: it can)."""
    del q_shape
    return pallas_unfit(view, call)


def tpu_attention(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: object,
    call: Call,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``(T, H, Dv)`` attention of a ragged batch on the Mosaic TPU kernel."""
    kc = kernel_call(q, pools, view, meta, call)
    num_tokens, heads, kvh, groups = kc.num_tokens, kc.heads, kc.kv_heads, kc.groups
    dk, dv, tile, plan, lay, slots = kc.dk, kc.dv, kc.tile, kc.plan, kc.lay, kc.slots
    head_dim = q.shape[2]
    m = tile * groups
    rows = plan.rows
    num_rows = plan.info.shape[0]
    cols = meta.block_table_tensor.shape[1]
    # Queries as (row, KV head, tile * G, D): one 2-D matmul per KV head.
    tok = jnp.where(rows.valid, rows.tok, 0)
    qr = q[tok].reshape(num_rows, tile, kvh, groups, head_dim)
    qr = jnp.transpose(qr, (0, 2, 1, 3, 4)).reshape(num_rows, kvh, m, head_dim)
    bounds = jnp.repeat(plan.bounds, groups, axis=1)  # (R, tile * G, 2)
    head_first = lay.roles.index("head") < lay.roles.index("token")
    page_block = tuple(
        None if r in ("block", "kv") else lay.slots_shape[1 + i]
        for i, r in enumerate(lay.roles)
    )

    def page_map(half: int):
        def index_map(r, c, info_ref, table_ref, layer_ref):
            req, first, end = info_ref[4 * r], info_ref[4 * r + 2], info_ref[4 * r + 3]
            # Past the row's last page: stay on it (the same block, no DMA).
            col = jnp.minimum(first + c, jnp.maximum(end - 1, first))
            page = table_ref[req * cols + jnp.minimum(col, cols - 1)]
            page = jnp.clip(page, 0, view.num_blocks - 1)
            slot = jnp.clip(layer_ref[0], 0, lay.slots_shape[0] - 1)
            by_role = {"block": page, "kv": half, "token": 0, "head": 0, "dim": 0}
            return (slot, *(by_role[r] for r in lay.roles))

        return pl.BlockSpec((None, *page_block), index_map)

    kv_specs = [page_map(0)] if lay.fused else [page_map(0), page_map(1)]
    kv_args = [slots] if lay.fused else [slots, slots]
    kernel = functools.partial(
        _kernel,
        lay=lay,
        head_first=head_first,
        kvh=kvh,
        block_size=view.block_size,
        dk=dk,
        dv=dv,
        cols=cols,
        scale=call.scale,
        cap=call.logits_soft_cap,
        num_blocks=view.num_blocks,
        fused=lay.fused,
    )
    row = lambda r, c, *_: (r, 0, 0, 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(num_rows, cols),
        in_specs=[
            pl.BlockSpec((None, m, 2), lambda r, c, *_: (r, 0, 0)),
            pl.BlockSpec((None, kvh, m, head_dim), row),
            *kv_specs,
        ],
        out_specs=pl.BlockSpec((None, kvh, m, dv), row),
        scratch_shapes=[
            pltpu.VMEM((kvh, m, 1), jnp.float32),
            pltpu.VMEM((kvh, m, 1), jnp.float32),
            pltpu.VMEM((kvh, m, dv), jnp.float32),
        ],
    )
    operands, out_shape = kernel_operands(
        (
            plan.info.reshape(-1),
            meta.block_table_tensor.astype(jnp.int32).reshape(-1),
            layer_of(layer, view),
            bounds,
            qr,
            *kv_args,
        ),
        (num_rows, kvh, m, dv),
        jnp.float32,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxkv_paged_attention_tpu",
    )(*operands)
    out = out.reshape(num_rows, kvh, tile, groups, dv)
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(num_rows, tile, heads, dv)
    return rows_to_tokens(out, rows, num_tokens, q.dtype)


def _kernel(
    info_ref,
    table_ref,
    layer_ref,
    bounds_ref,
    q_ref,
    *refs,
    lay: PageLayout,
    head_first: bool,
    kvh: int,
    block_size: int,
    dk: int,
    dv: int,
    cols: int,
    scale: float,
    cap: float | None,
    num_blocks: int,
    fused: bool,
) -> None:
    if fused:
        (kv_ref, o_ref, top_ref, denom_ref, acc_ref) = refs
        k_ref = v_ref = kv_ref
    else:
        (k_ref, v_ref, o_ref, top_ref, denom_ref, acc_ref) = refs
    r, c = pl.program_id(0), pl.program_id(1)
    req, first, end = info_ref[4 * r], info_ref[4 * r + 2], info_ref[4 * r + 3]
    col = first + c
    page = table_ref[req * cols + jnp.minimum(col, cols - 1)]
    layer = layer_ref[0]
    # A layer slot or page id outside the pool reads as NaN, as XLA's gather
    # fills it (the DMA itself was clamped to a real page).
    ok = (page >= 0) & (page < num_blocks) & (layer >= 0) & (layer < lay.slots_shape[0])
    live = col < end

    @pl.when(c == 0)
    def _init():
        top_ref[...] = jnp.full(top_ref.shape, _MASKED, jnp.float32)
        denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(live)
    def _page():
        k_page = k_ref[...]
        v_page = v_ref[...]
        if k_page.dtype != lay.dtype:  # a bits pool: the same bytes, as floats
            k_page = jax.lax.bitcast_convert_type(k_page, lay.dtype)
            v_page = jax.lax.bitcast_convert_type(v_page, lay.dtype)
        lo = bounds_ref[:, 0:1]  # (M, 1)
        hi = bounds_ref[:, 1:2]
        m = lo.shape[0]
        j = col * block_size + jax.lax.broadcasted_iota(jnp.int32, (m, block_size), 1)
        vis = (j >= lo) & (j < hi)  # (M, N)
        seen = jnp.max(vis.astype(jnp.float32), axis=0, keepdims=True) > 0  # (1, N)
        for h in range(kvh):
            k = k_page[h] if head_first else k_page[:, h]  # (N, D[k|v])
            v = v_page[h] if head_first else v_page[:, h]
            k = jnp.where(ok, k[:, :dk].astype(jnp.float32), jnp.nan)
            v = jnp.where(ok, (v[:, dk:] if fused else v).astype(jnp.float32), jnp.nan)
            q = q_ref[h].astype(jnp.float32)  # (M, Dk)
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            s = s * scale
            if cap is not None:
                s = cap * jnp.tanh(s / cap)
            s = jnp.where(vis, s, _MASKED)
            top = top_ref[h]  # (M, 1)
            new_top = jnp.maximum(top, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(vis, jnp.exp(s - new_top), 0.0)
            rescale = jnp.exp(top - new_top)
            denom_ref[h] = denom_ref[h] * rescale + jnp.sum(p, axis=1, keepdims=True)
            # Keys no query of the row sees may be NaN padding: zero them.
            v = jnp.where(seen.T, v, 0.0)
            pv = jax.lax.dot_general(
                p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc_ref[h] = acc_ref[h] * rescale + pv
            top_ref[h] = new_top

    @pl.when(c == pl.num_programs(1) - 1)
    def _store():
        denom = denom_ref[...]
        o_ref[...] = acc_ref[...] / jnp.where(denom > 0, denom, 1.0)
