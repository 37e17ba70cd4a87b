"""The row arithmetic of paged attention.

Which request and position each query token has, query tokens grouped into rows of one
request, the chunks of pages a row must visit, the mask of the keys it sees, and one
online-softmax step over a chunk. :func:`paged_attention` composes them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxkv.plan import KVCacheView
from jaxkv.step import CommonAttentionMetadata


def token_requests_and_positions(
    meta: CommonAttentionMetadata, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Request, absolute position and validity of each of `num_tokens` tokens.

    Positions come from ``seq_lens`` and ``query_start_loc`` (a request's
    query is the trailing part of its sequence), so they also hold for the
    reduced fast-prefill batch: qsl = [0, 4, 5], seq_lens = [9, 3] ->
    positions [5, 6, 7, 8, 2].
    """
    qsl = meta.query_start_loc
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(qsl[1:], t, side="right").astype(jnp.int32)
    req = jnp.minimum(req, meta.max_reqs - 1)
    valid = t < meta.num_actual_tokens
    pos = meta.seq_lens[req] - (qsl[req + 1] - t)
    return req, pos, valid


def request_token_rows(
    meta: CommonAttentionMetadata, width: int
) -> Int[Array, "max_reqs width"]:
    """Each request's query tokens as a row of step-token indices.

    In order, ``-1`` past its query (and for padded requests): the per-request view a
    recurrent layer scans, ``x[jnp.maximum(rows, 0)]`` masked by ``rows >= 0``.

    `width` must be at least the step's longest query (``num_tokens`` of the
    bucket is always enough); tokens past it are left out.

    Example:
      >>> import dataclasses
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> m = jaxkv.CommonAttentionMetadata.empty(max_reqs=3, max_tokens=8,
      ...                                         max_blocks=1)
      >>> m = dataclasses.replace(m, num_reqs=jnp.int32(2),
      ...     query_start_loc=jnp.array([0, 3, 4, 4]))
      >>> jaxkv.request_token_rows(m, 3).tolist()
      [[0, 1, 2], [3, -1, -1], [-1, -1, -1]]
    """
    qsl = meta.query_start_loc.astype(jnp.int32)
    live = jnp.arange(meta.max_reqs, dtype=jnp.int32) < meta.num_reqs
    q_lens = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    return jnp.where(col < q_lens[:, None], qsl[:-1, None] + col, -1)


class Mask(NamedTuple):
    """The static masking options of one attention call."""

    causal: bool
    sliding_window: int | None
    attention_chunk_size: int | None
    cross_attention: bool
    use_mm_prefix: bool

    @property
    def windowed(self) -> bool:
        """Whether a row's first visible key can be past its request's start."""
        return not self.cross_attention and (
            self.sliding_window is not None or self.attention_chunk_size is not None
        )


class Rows(NamedTuple):
    """Query rows: each row holds up to `tile` query tokens of one request."""

    req: jax.Array  # (rows,) the row's request
    tok: jax.Array  # (rows, tile) token ids, -1 = empty slot
    valid: jax.Array  # (rows, tile)
    pos: jax.Array  # (rows, tile) the tokens' positions
    kv_len: jax.Array  # (rows,) keys the row's request has
    table: jax.Array  # (rows, num_chunks * chunk) the request's pages, padded


def query_rows_of(
    meta: CommonAttentionMetadata,
    num_tokens: int,
    tile: int,
    opts: Mask,
    width: int,
    *,
    block_size: int,
) -> Rows:
    """The step's query rows with their positions, key counts and page tables.

    A row's keys stop at its request's length or at the block table's end,
    whichever is first: keys at positions past ``cols * block_size`` (a
    ``seq_len`` longer than the table holds) are never seen, on every
    implementation (the table has no page for them).
    """
    row_req, tok = query_rows(meta, num_tokens, tile)
    valid = tok >= 0
    safe_tok = jnp.where(valid, tok, 0)
    qsl = meta.query_start_loc
    pos = meta.seq_lens[row_req][:, None] - (qsl[row_req + 1][:, None] - safe_tok)
    table = meta.block_table_tensor[row_req]  # (rows, cols): the row's pages
    table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])))
    kv_len = (
        meta.encoder_seq_lens[row_req]
        if opts.cross_attention
        else meta.seq_lens[row_req]
    )
    cols = meta.block_table_tensor.shape[1]
    kv_len = jnp.minimum(kv_len, jnp.int32(cols * block_size))
    return Rows(row_req, tok, valid, pos, kv_len.astype(jnp.int32), table)


def key_ranges(
    rows: Rows, meta: CommonAttentionMetadata, opts: Mask
) -> tuple[jax.Array, jax.Array]:
    """``(lo, hi)``, each ``(rows, tile)``: the keys ``[lo, hi)`` each query sees.

    Every mask but PrefixLM's makes a query's visible keys one contiguous
    range: up to its own position (causal requests), from the start of its
    window or local chunk, up to the end of its chunk and of its request's
    keys. Empty slots get the empty range ``[0, 0)``. It is :func:`visible`
    for masks without ``use_mm_prefix``, as bounds: what the kernels that
    walk a row's pages take.
    """
    hi = jnp.broadcast_to(rows.kv_len[:, None], rows.pos.shape)
    lo = jnp.zeros_like(hi)
    pos = rows.pos
    if not opts.cross_attention:
        if opts.causal:
            own = jnp.minimum(hi, pos + 1)
            hi = jnp.where(meta.request_causal[rows.req][:, None], own, hi)
        if opts.sliding_window is not None:
            lo = jnp.maximum(lo, pos - opts.sliding_window + 1)
        if opts.attention_chunk_size is not None:
            size = opts.attention_chunk_size
            lo = jnp.maximum(lo, pos // size * size)
            hi = jnp.minimum(hi, (pos // size + 1) * size)
    hi = jnp.where(rows.valid, hi, 0).astype(jnp.int32)
    lo = jnp.where(rows.valid, jnp.clip(lo, 0, hi), 0).astype(jnp.int32)
    return lo, hi


def chunk_range(
    rows: Rows, opts: Mask, span: int, num_chunks: int
) -> tuple[jax.Array, jax.Array]:
    """``(first chunk per row, loop trips)``.

    Each row visits only the chunks that can hold a key it sees: up to its
    context, and from the earliest key its window or local chunk still shows
    (older pages may be freed: null-block entries). Rows share the loop, so it
    runs as many steps as the row spanning the most chunks.
    """
    live = jnp.any(rows.valid, axis=1)
    end_chunk = (rows.kv_len + span - 1) // span  # (rows,) exclusive
    first_chunk = jnp.zeros_like(end_chunk)
    if opts.windowed:
        big = jnp.iinfo(jnp.int32).max
        row_first = jnp.min(jnp.where(rows.valid, rows.pos, big), axis=1)  # (rows,)
        lo = jnp.zeros_like(row_first)
        if opts.sliding_window is not None:
            lo = jnp.maximum(lo, row_first - opts.sliding_window + 1)
        if opts.attention_chunk_size is not None:
            size = opts.attention_chunk_size
            lo = jnp.maximum(lo, row_first // size * size)
        first_chunk = jnp.where(live, lo // span, 0)
    row_trips = jnp.where(live, jnp.maximum(end_chunk - first_chunk, 0), 0)
    return first_chunk, jnp.minimum(jnp.max(row_trips), num_chunks)


def visible(
    rows: Rows, meta: CommonAttentionMetadata, opts: Mask, j: jax.Array
) -> jax.Array:
    """(rows, tile, span) mask of the keys at positions `j` (rows or 1, span)."""
    j = j[:, None, :]
    p = rows.pos[:, :, None]  # (rows, tile, 1)
    mask = (j < rows.kv_len[:, None, None]) & rows.valid[:, :, None]
    if opts.cross_attention:
        return mask
    if opts.causal:
        # Requests marked non-causal see their whole context.
        causal = (j <= p) | ~meta.request_causal[rows.req][:, None, None]
        if opts.use_mm_prefix:
            # Inclusive ranges [s, e]: a query inside one sees the whole range.
            ranges = meta.mm_prefix_ranges[rows.req]  # (rows, max_ranges, 2)
            count = meta.mm_num_ranges[rows.req][:, None]
            live = jnp.arange(ranges.shape[1], dtype=jnp.int32)[None, :] < count
            s = ranges[..., 0][:, None, :, None]  # (rows, 1, ranges, 1)
            e = ranges[..., 1][:, None, :, None]
            pp = p[:, :, :, None]  # (rows, tile, 1, 1)
            inside_q = live[:, None, :, None] & (s <= pp) & (pp <= e)
            inside_k = (s <= j[:, :, None, :]) & (j[:, :, None, :] <= e)
            causal = causal | jnp.any(inside_q & inside_k, axis=2)
        mask = mask & causal
    if opts.sliding_window is not None:
        mask = mask & (j > p - opts.sliding_window)
    if opts.attention_chunk_size is not None:
        size = opts.attention_chunk_size
        mask = mask & (j // size == p // size)
    return mask


def online_softmax_step(
    carry: tuple[jax.Array, ...],
    qg: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
    logits_soft_cap: float | None,
    contraction: str = "dot",
) -> tuple[jax.Array, ...]:
    """One chunk of keys folded into ``(running max, denominator, numerator)``.

    `contraction` is how scores and values are contracted: ``"dot"`` as dot
    products (matrix units), ``"reduce"`` as a broadcast multiply and a sum,
    which XLA fuses with the page gather that produces `k` and `v` (no
    gathered chunk is written out).
    """
    top, denom, acc = carry
    # Scores of unseen keys are masked below (a NaN padding key drops out);
    # unseen values are zeroed, as their weight 0 times NaN is NaN.
    seen = jnp.any(mask, axis=1)[:, :, None, None]
    k = k.astype(jnp.float32)
    v = jnp.where(seen, v, 0).astype(jnp.float32)
    if contraction == "reduce":
        kh = jnp.swapaxes(k, 1, 2)[:, None, :, None]  # (n, 1, h, 1, l, d)
        scores = jnp.sum(qg[:, :, :, :, None, :] * kh, axis=-1) * scale
    else:
        scores = jnp.einsum("nqhgd,nlhd->nqhgl", qg, k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    m5 = mask[:, :, None, None, :]
    scores = jnp.where(m5, scores, -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
    safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    weights = jnp.where(m5, jnp.exp(scores - safe[..., None]), 0.0)
    rescale = jnp.where(jnp.isfinite(top), jnp.exp(top - safe), 0.0)
    denom = denom * rescale + jnp.sum(weights, axis=-1)
    if contraction == "reduce":
        vh = jnp.swapaxes(v, 1, 2)[:, None, :, None]  # (n, 1, h, 1, l, d)
        values = jnp.sum(weights[..., None] * vh, axis=-2)
    else:
        values = jnp.einsum("nqhgl,nlhd->nqhgd", weights, v)
    acc = acc * rescale[..., None] + values
    return new_top, denom, acc


def query_rows(
    meta: CommonAttentionMetadata, num_tokens: int, tile: int
) -> tuple[jax.Array, jax.Array]:
    """Rows of `tile` query tokens, each row inside one request.

    Returns ``(row_request (rows,), tokens (rows, tile))`` with ``-1`` for empty
    slots; ``rows = ceil(num_tokens / tile) + max_reqs`` bounds the count (each
    request adds at most one partial row). qsl = [0, 5, 6], tile = 4 ->
    rows [[0, 1, 2, 3], [4, -1, -1, -1], [5, -1, -1, -1], ...].
    """
    req, _, valid = token_requests_and_positions(meta, num_tokens)
    if tile == 1:
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        return req, jnp.where(valid, t, -1)[:, None]
    qsl = meta.query_start_loc
    max_reqs = meta.max_reqs
    live = jnp.arange(max_reqs, dtype=jnp.int32) < meta.num_reqs
    q_lens = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    per_req = (q_lens + tile - 1) // tile
    ends = jnp.cumsum(per_req, dtype=jnp.int32)
    rows = -(-num_tokens // tile) + max_reqs
    r = jnp.arange(rows, dtype=jnp.int32)
    row_req = jnp.minimum(
        jnp.searchsorted(ends, r, side="right").astype(jnp.int32), max_reqs - 1
    )
    local = r - (ends[row_req] - per_req[row_req])
    tok = (
        qsl[row_req][:, None]
        + local[:, None] * tile
        + jnp.arange(tile, dtype=jnp.int32)[None, :]
    )
    ok = (
        (r < ends[-1])[:, None] & (tok < qsl[row_req + 1][:, None]) & (tok < num_tokens)
    )
    return row_req, jnp.where(ok, tok, -1)


def value_dim(view: KVCacheView, head_dim: int) -> int:
    """Value head size of a view: D for K/V axes and MLA, Dv for fused K|V."""
    if "head" in view.axes and "kv" not in view.axes:
        return view.shape[view.dim("dim")] - view.head_size
    return head_dim
