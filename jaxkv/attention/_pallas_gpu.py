"""Paged attention as a Triton-lowered Pallas kernel (NVIDIA and AMD GPUs).

One program per (query row, KV head), after jax's own
``jax.experimental.pallas.ops.gpu.paged_attention`` (a program walks its
sequence's pages through the block table with an online softmax), made
ragged: a row is up to ``query_tile`` consecutive query tokens of one
request (a decode token, or a tile of a prefill chunk), and it walks only
the page columns ``[first, end)`` that hold a key one of its queries sees
(:func:`jaxkv.attention._call.row_plan`: causal, sliding window, local
chunk, cross-attention, keys past the table dropped). Each page of its KV
head is loaded once, in place, from the layer's slot of a typed pool (the
pool reshaped to ``(L, *physical shape)``, a bitcast; the layer slot may be
traced, so one kernel serves every layer of a ``lax.scan``); the row's
``tile * G`` query heads of that KV head (GQA) share the load.

Why Triton and not Mosaic GPU: the kernel's loads are data-dependent
gathers of small pages (a block table entry, then ``(block_size, head_dim)``
elements), which Triton lowers to pointer arithmetic on any CUDA or ROCm
GPU; Mosaic GPU (the default ``pallas_call`` backend on jax 0.10) wants
TMA-sized tiles and warpgroup semantics on Hopper and newer only. jax's own
GPU paged and decode attention kernels are Triton for the same reason.

On CPU the same kernel runs in Pallas's interpret mode (``interpret=True``),
which is how CI checks it against XLA's path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxkv._util import kernel_operands
from jaxkv.attention._call import (
    Call,
    head_dims,
    kernel_call,
    kv_heads_of,
    layer_of,
    pallas_unfit,
    rows_to_tokens,
)
from jaxkv.kv import PageLayout, Pools
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata

_MASKED = -1e30  # finite: no inf - inf in the running max of an empty row
_DOT_MIN = 16  # tl.dot needs every dim >= 16; smaller ones multiply and sum


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gpu_unfit(view: KVCacheView, call: Call, q_shape: tuple[int, ...]) -> str | None:
    """Why the GPU kernel cannot take this call (``None``: it can).

    On top of :func:`pallas_unfit`: Triton's blocks are powers of two, so
    the block size, the head dims, the query heads per KV head and the
    query tile must be.
    """
    reason = pallas_unfit(view, call)
    if reason is not None:
        return reason
    _, heads, head_dim = q_shape
    kvh = kv_heads_of(view)
    dk, dv = head_dims(view, head_dim)
    sizes = {
        "block_size": view.block_size,
        "head dim": dk,
        "value head dim": dv,
        "query heads per KV head": heads // kvh,
        "query_tile": call.query_tile,
    }
    for what, n in sizes.items():
        if not _pow2(n):
            return f"{what} {n} (Triton blocks are powers of two)"
    return None


def gpu_attention(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: object,
    call: Call,
    *,
    interpret: bool = False,
) -> jax.Array:
    """``(T, H, Dv)`` attention of a ragged batch on the Triton kernel."""
    kc = kernel_call(q, pools, view, meta, call)
    num_tokens, heads, kvh, groups = kc.num_tokens, kc.heads, kc.kv_heads, kc.groups
    dk, dv, tile, plan, lay = kc.dk, kc.dv, kc.tile, kc.plan, kc.lay
    # A row's tile may run past the last token: pad so its load stays inside.
    q_padded = jnp.pad(q, ((0, tile), (0, 0), (0, 0)))
    kernel = functools.partial(
        _kernel,
        lay=lay,
        tile=tile,
        groups=groups,
        block_size=view.block_size,
        dk=dk,
        dv=dv,
        scale=call.scale,
        cap=call.logits_soft_cap,
        num_blocks=view.num_blocks,
    )
    num_rows = plan.info.shape[0]
    operands, out_shape = kernel_operands(
        (
            plan.info,
            plan.bounds,
            meta.block_table_tensor.astype(jnp.int32),
            layer_of(layer, view),
            q_padded,
            kc.slots,
        ),
        (num_rows, tile, heads, dv),
        jnp.float32,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_rows, kvh),
        in_specs=[pl.no_block_spec] * 6,
        out_specs=pl.BlockSpec((None, tile, groups, dv), lambda r, h: (r, 0, h, 0)),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxkv_paged_attention_gpu",
    )(*operands)
    return rows_to_tokens(out, plan.rows, num_tokens, q.dtype)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """``(tile, G, D) x (N, D) -> (tile, G, N)`` in float32."""
    tile, groups, d = q.shape
    n = k.shape[0]
    if tile * groups >= _DOT_MIN and n >= _DOT_MIN and d >= _DOT_MIN:
        s = pltriton.dot(q.reshape(tile * groups, d), k, trans_b=True, allow_tf32=False)
        return s.reshape(tile, groups, n)
    return jnp.sum(q[:, :, None, :] * k[None, None, :, :], axis=-1)


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """``(tile, G, N) x (N, Dv) -> (tile, G, Dv)`` in float32."""
    tile, groups, n = p.shape
    dv = v.shape[1]
    if tile * groups >= _DOT_MIN and n >= _DOT_MIN and dv >= _DOT_MIN:
        out = pltriton.dot(p.reshape(tile * groups, n), v, allow_tf32=False)
        return out.reshape(tile, groups, dv)
    return jnp.sum(p[:, :, :, None] * v[None, None, :, :], axis=2)


def _kernel(
    info_ref,
    bounds_ref,
    table_ref,
    layer_ref,
    q_ref,
    pool_ref,
    o_ref,
    *,
    lay: PageLayout,
    tile: int,
    groups: int,
    block_size: int,
    dk: int,
    dv: int,
    scale: float,
    cap: float | None,
    num_blocks: int,
) -> None:
    r, h = pl.program_id(0), pl.program_id(1)
    req, start = info_ref[r, 0], info_ref[r, 1]
    first, end = info_ref[r, 2], info_ref[r, 3]
    lo = bounds_ref[r, :, 0]  # (tile,)
    hi = bounds_ref[r, :, 1]
    num_layers = lay.slots_shape[0]
    layer = layer_ref[0]
    # A layer slot or page id outside the pool reads as NaN, as XLA's gather
    # fills it (never another layer's or block's bytes, never a wrapped id).
    layer_ok = (layer >= 0) & (layer < num_layers)
    layer = jnp.clip(layer, 0, num_layers - 1)
    q = q_ref[pl.ds(start, tile), pl.ds(h * groups, groups), :].astype(jnp.float32)
    v_at = dk if lay.fused else 0

    def load(page: jax.Array, ok: jax.Array, half: int, at: int, width: int):
        x = pool_ref[lay.at(layer, page, h, half, pl.ds(at, width))]
        if x.dtype != lay.dtype:  # a bits pool: the same bytes, as floats
            x = jax.lax.bitcast_convert_type(x, lay.dtype)
        return jnp.where(ok, x.astype(jnp.float32), jnp.nan)

    def body(c, carry):
        top, denom, acc = carry
        page = table_ref[req, c]
        ok = layer_ok & (page >= 0) & (page < num_blocks)
        page = jnp.clip(page, 0, num_blocks - 1)
        k = load(page, ok, 0, 0, dk)  # (N, Dk)
        v = load(page, ok, 1, v_at, dv)  # (N, Dv)
        s = _scores(q, k) * scale
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        j = c * block_size + jnp.arange(block_size, dtype=jnp.int32)
        vis = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
        vis3 = jnp.broadcast_to(vis[:, None, :], s.shape)
        s = jnp.where(vis3, s, _MASKED)
        new_top = jnp.maximum(top, jnp.max(s, axis=-1))
        p = jnp.where(vis3, jnp.exp(s - new_top[:, :, None]), 0.0)
        rescale = jnp.exp(top - new_top)
        denom = denom * rescale + jnp.sum(p, axis=-1)
        # Keys no query of the row sees may be NaN padding: zero them, as
        # their weight 0 times NaN is NaN.
        seen = jnp.max(vis.astype(jnp.int32), axis=0) > 0  # (N,)
        v = jnp.where(seen[:, None], v, 0.0)
        acc = acc * rescale[:, :, None] + _weighted(p, v)
        return new_top, denom, acc

    init = (
        jnp.full((tile, groups), _MASKED, jnp.float32),
        jnp.zeros((tile, groups), jnp.float32),
        jnp.zeros((tile, groups, dv), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, end, body, init)
    o_ref[...] = acc / jnp.where(denom > 0, denom, 1.0)[:, :, None]
