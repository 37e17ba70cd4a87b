"""Paged attention on XLA: the reference every other implementation meets.

Every query token reads the pages of its own request through the layer's view
(``gather_kv_pages``: index arithmetic on the pool, never a pool copy), a chunk
of pages at a time, with an online softmax; each row of queries visits only
the chunks that can hold a key it sees (up to its context, from the start of
its window or local chunk). One kernel covers mixed prefill/decode batches,
GQA, causal, sliding-window and chunked-local masks, cross-attention over
cached encoder K/V, PrefixLM multimodal ranges and
logits soft-capping. Padding pages and padded tokens never reach an output:
masked keys are removed with ``where`` (so NaN pages cannot leak) and tokens
with no visible key produce zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxkv._util import varying_like
from jaxkv.attention._call import Call, kv_heads_of
from jaxkv.attention._rows import (
    chunk_range,
    online_softmax_step,
    query_rows_of,
    value_dim,
    visible,
)
from jaxkv.kv import PER_TOKEN_HEAD, Pools, dequantize, gather_kv_pages, scale_view
from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata


def resolve_contraction(
    contraction: str, query_tile: int, *, platform: str | None = None
) -> str:
    """What `contraction` means on XLA's path for rows of `query_tile` tokens.

    Args:
      contraction: One of :data:`CONTRACTIONS`.
      query_tile: Query tokens per row.
      platform: The platform compiled for (``"cpu"``, or anything else for a
        device); ``None``: the default backend's (on the host, never while
        tracing: the same program may be lowered for another platform).

    Returns:
      ``"dot"`` or ``"reduce"``: ``"auto"`` is ``"reduce"`` on CPU for rows
      of more than one token, ``"dot"`` otherwise.

    Raises:
      ValueError: For a name not in :data:`CONTRACTIONS`.

    Example:
      >>> import jax
      >>> from jaxkv.attention import resolve_contraction
      >>> cpu = jax.default_backend() == "cpu"
      >>> resolve_contraction("auto", 16) == ("reduce" if cpu else "dot")
      True
      >>> resolve_contraction("auto", 1), resolve_contraction("reduce", 1)
      ('dot', 'reduce')
    """
    if contraction not in CONTRACTIONS:
        hint = (
            " (the C++ kernel is implementation='native')"
            if contraction == "native"
            else ""
        )
        raise ValueError(
            f"paged_attention: contraction={contraction!r}, expected one of "
            f"{CONTRACTIONS}{hint}."
        )
    if contraction != "auto":
        return contraction
    tuned = xla_tuning(platform or jax.default_backend())
    return tuned["tile_contraction"] if query_tile > 1 else "dot"


CONTRACTIONS = ("auto", "dot", "reduce")
"""What ``paged_attention(contraction=)`` takes (XLA's path)."""

XLA_TUNING: dict[str, dict[str, Any]] = {
    "cpu": {"pages_per_chunk": 4, "tile_contraction": "reduce"},
    "*": {"pages_per_chunk": 64, "tile_contraction": "dot"},
}
"""XLA's path's tuned defaults per platform (``"*"``: every device).

On XLA:CPU the page gather dominates, so chunks past a row's context cost
more than the loop's trips, and rows of several queries are reduced (a
broadcast multiply and a sum fused with the gather); on a GPU or TPU few
large chunks and dot products win (``benchmarks/bench_attention.py``,
``bench_serve.py``; figures in ``benchmarks/README.md``). The table entry of
XLA's path carries it (``ATTENTION_KERNELS.tuned("xla", platform)``).
"""


def xla_tuning(platform: str) -> dict[str, Any]:
    """:data:`XLA_TUNING` of `platform` (``"*"``'s for a device)."""
    return XLA_TUNING.get(platform, XLA_TUNING["*"])


def auto_pages_per_chunk(platform: str | None = None) -> int:
    """Pages per chunk that ``pages_per_chunk=None`` means on `platform`.

    `platform`: ``"cpu"``, or anything else for a device; ``None``: the
    default backend's (on the host, never while tracing).

    4 on CPU, 64 elsewhere (:data:`XLA_TUNING`).

    Example:
      >>> import jax
      >>> from jaxkv.attention import auto_pages_per_chunk
      >>> auto_pages_per_chunk() == (4 if jax.default_backend() == "cpu" else 64)
      True
    """
    return xla_tuning(platform or jax.default_backend())["pages_per_chunk"]


def tuning(call: Call, *, platform: str) -> tuple[str, int]:
    """XLA's path's ``(contraction, pages per chunk)`` for `call` on `platform`.

    Decided per platform at lowering (``platform`` is the one compiled for),
    never from the process's default backend while tracing.

    Example:
      >>> from jaxkv.attention._call import Call
      >>> from jaxkv.attention._rows import Mask
      >>> from jaxkv.attention._xla import tuning
      >>> call = Call(Mask(True, None, None, False, False), 1.0, None, None, 16,
      ...             "auto")
      >>> tuning(call, platform="cpu"), tuning(call, platform="tpu")
      (('reduce', 4), ('dot', 64))
    """
    contraction = resolve_contraction(
        call.contraction, call.query_tile, platform=platform
    )
    pages = call.pages_per_chunk or auto_pages_per_chunk(platform)
    return contraction, pages


def xla_attention(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: jax.Array | None,
    call: Call,
    *,
    platform: str,
) -> jax.Array:
    """``(T, H, Dv)`` attention of a ragged batch on XLA's path (the reference).

    `platform`: the one compiled for (``"cpu"`` or a device's), which tunes
    the contraction and chunk defaults (:func:`tuning`).
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = kv_heads_of(view)
    opts = call.mask
    scale, logits_soft_cap = call.scale, call.logits_soft_cap
    query_tile = call.query_tile
    contraction, pages_per_chunk = tuning(call, platform=platform)
    groups = num_heads // kv_heads
    head_dim_v = value_dim(view, head_dim)
    cols = meta.block_table_tensor.shape[1]
    chunk = max(1, min(pages_per_chunk, cols))
    num_chunks = -(-cols // chunk)
    span = chunk * view.block_size
    rows = query_rows_of(
        meta,
        num_tokens,
        query_tile,
        opts,
        num_chunks * chunk,
        block_size=view.block_size,
    )
    # Rows of one token are the tokens in order: no gather of the queries and
    # no scatter of the outputs (a padded token's row sees no key: zeros).
    in_order = query_tile == 1
    if in_order:
        qg = q.reshape(num_tokens, 1, kv_heads, groups, head_dim)
    else:
        safe_tok = jnp.where(rows.valid, rows.tok, 0)
        qg = q[safe_tok].reshape(*rows.tok.shape, kv_heads, groups, head_dim)
    qg = qg.astype(jnp.float32)
    first_chunk, trips = chunk_range(rows, opts, span, num_chunks)
    page_ids = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    key_ids = jnp.arange(span, dtype=jnp.int32)

    def body(c: jax.Array | int, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        # Row r reads its chunk first_chunk[r] + c; past its table it re-reads
        # the last chunk, whose keys the mask then hides (j >= kv_len).
        if opts.windowed:
            at = first_chunk + c  # (rows,)
            cols_at = jnp.minimum(at, num_chunks - 1)[:, None] * chunk + page_ids
            pages = jnp.take_along_axis(rows.table, cols_at, axis=1)
            j = at[:, None] * span + key_ids[None, :]  # (rows, span)
        else:  # every row starts at chunk 0: one slice of the table
            pages = jax.lax.dynamic_slice_in_dim(rows.table, c * chunk, chunk, axis=1)
            j = (c * span + key_ids)[None, :]  # (1, span)
        k_pages, v_pages = gather_kv_pages(pools, view, pages, layer=layer)
        if v_pages is None:  # MLA: the latent is both key and value
            v_pages = k_pages
        n = pages.shape[0]
        k = k_pages.reshape(n, span, kv_heads, -1)
        v = v_pages.reshape(n, span, kv_heads, -1)
        if view.kv_quant_mode in PER_TOKEN_HEAD:  # the pages' own scales
            ks, vs = gather_kv_pages(pools, scale_view(view), pages)
            k = dequantize(k, ks.reshape(n, span, kv_heads, 1))
            v = dequantize(v, vs.reshape(n, span, kv_heads, 1))
        elif view.kv_quant_mode == "fp8_per_tensor":
            k, v = dequantize(k, call.k_scale), dequantize(v, call.v_scale)
        mask = visible(rows, meta, opts, j)  # (rows, tile, span)
        return online_softmax_step(
            carry, qg, k, v, mask, scale, logits_soft_cap, contraction
        )

    shape = (*rows.tok.shape, kv_heads, groups)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim_v), jnp.float32),
    )
    # Under shard_map (check_vma on) the carry must vary over the mesh axes the
    # body's inputs vary over (the pool's, the queries', the metadata's).
    init = varying_like(init, (q, pools[view.pool], *jax.tree.leaves(meta)))
    if num_chunks == 1:  # the whole table in one chunk: no loop
        _, denom, acc = body(0, init)
    else:
        _, denom, acc = jax.lax.fori_loop(0, trips, body, init)
    rows_out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    rows_out = rows_out.reshape(*rows.tok.shape, num_heads, head_dim_v)
    if in_order:
        return rows_out.reshape(num_tokens, num_heads, head_dim_v).astype(q.dtype)
    out = jnp.zeros((num_tokens, num_heads, head_dim_v), jnp.float32)
    out = out.at[jnp.where(rows.valid, rows.tok, num_tokens)].set(rows_out, mode="drop")
    return out.astype(q.dtype)
