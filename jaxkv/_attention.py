"""A pure-JAX ragged paged attention that reads K/V through layer views.

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

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from jaxkv.cache import (
    AttentionLayer,
    KVCacheView,
    LayerView,
    Pools,
    check_layer,
    check_pools_alive,
    gather_kv_pages,
)
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
    """Each request's query tokens as a row of step-token indices, in order,
    ``-1`` past its query (and for padded requests): the per-request view a
    recurrent layer scans, ``x[jnp.maximum(rows, 0)]`` masked by
    ``rows >= 0``.

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
    """  # noqa: D205
    qsl = meta.query_start_loc.astype(jnp.int32)
    live = jnp.arange(meta.max_reqs, dtype=jnp.int32) < meta.num_reqs
    q_lens = jnp.where(live, qsl[1:] - qsl[:-1], 0)
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    return jnp.where(col < q_lens[:, None], qsl[:-1, None] + col, -1)


def paged_attention(
    q: Float[Array, "num_tokens num_heads head_dim"],
    pools: Pools,
    view: LayerView | AttentionLayer,
    meta: CommonAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    cross_attention: bool | None = None,
    use_mm_prefix: bool = False,
    pages_per_chunk: int = 4,
    query_tile: int | None = None,
    layer: Int[ArrayLike, ""] | None = None,
) -> Float[Array, "num_tokens num_heads head_dim_v"]:
    """Attention of a ragged batch over K/V read through a layer's view.

    Args:
      q: ``(num_tokens, num_heads, head_dim)`` queries, ``num_heads`` a multiple
        of the view's KV heads (GQA).
      pools: The pool arrays.
      view: The layer's :class:`AttentionLayer` (``plan.attention_layer(name)``:
        window, local chunk, soft cap and cross-attention come from its spec;
        an explicit argument that contradicts them raises), or its bare bound
        view (then only the arguments given apply). ``meta.block_table_tensor``
        must be in the view's block space (kernel blocks for kernel views).
      meta: The group's step metadata.
      scale: Softmax scale.
      sliding_window: Keys within the last `sliding_window` positions only,
        the query's own included (``p - W + 1 .. p``).
      attention_chunk_size: Keys in the query's chunk only.
      logits_soft_cap: ``cap * tanh(s / cap)`` on the scores.
      cross_attention: Keys are the request's cached encoder K/V
        (``encoder_seq_lens``), no causal mask.
      use_mm_prefix: Tokens inside one multimodal range see each other
        bidirectionally (PrefixLM).
      pages_per_chunk: Pages gathered per step of the online softmax; only the
        chunks holding keys a row can see are visited.
      query_tile: Query tokens of one request that share one read of its
        pages. 1 suits decode batches; prefill chunks want 8-32 (each request
        then costs at most one partly empty tile). Default: 16 when the bucket
        holds more tokens than requests (prefill chunks), else 1.
      layer: For a layer-stacked typed pool: the layer slot to read, possibly
        traced (``lax.scan`` over the layers of one stack, with `view` any
        of them: they share one view but for the slot); ``None``: the view's.

    Returns:
      ``(num_tokens, num_heads, head_dim_v)``; zero for padded tokens.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.cache.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.vllm.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.vllm.init_kv_cache(kv, cfg, sizes, groups)
      >>> view = views["layers.0.self_attn"]
      >>> k = jnp.arange(2 * 2 * 32, dtype=jnp.float32).reshape(2, 2, 32) / 100
      >>> pools = jaxkv.write_kv(pools, view, k, k + 1, jnp.array([32, 33]))
      >>> meta = jaxkv.vllm.build_attn_metadata(
      ...     groups, 1, 2, jnp.array([0, 2]), None, 2, jnp.array([2]), 2,
      ...     [jnp.array([[1]])] * 3, [jnp.array([32, 33])] * 3, kv)
      >>> meta = meta["layers.0.self_attn"]
      >>> out = jaxkv.paged_attention(jnp.zeros((2, 4, 32)), pools, view, meta,
      ...                             scale=1.0)
      >>> bool(np.allclose(out[0, 0], k[0, 0] + 1))  # sees only itself
      True
      >>> bool(np.allclose(out[1, 0], k[:, 0].mean(0) + 1))  # zero q: mean of v
      True
    """
    if isinstance(view, AttentionLayer):
        given = {
            "sliding_window": sliding_window,
            "attention_chunk_size": attention_chunk_size,
            "logits_soft_cap": logits_soft_cap,
            "cross_attention": cross_attention,
        }
        for arg, value in given.items():
            own = getattr(view, arg)
            if value is not None and value != own:
                raise ValueError(
                    f"paged_attention: {arg}={value!r} contradicts layer "
                    f"{view.name!r}, whose spec gives {arg}={own!r}."
                )
        sliding_window, attention_chunk_size = (
            view.sliding_window,
            view.attention_chunk_size,
        )
        logits_soft_cap, cross_attention = view.logits_soft_cap, view.cross_attention
        view = view.view
    elif (
        isinstance(view, KVCacheView)
        and view.windowed
        and sliding_window is None
        and attention_chunk_size is None
    ):
        raise ValueError(
            "paged_attention: this view belongs to a layer with a sliding window "
            "or local chunk, and no window was given; pass the layer's "
            "AttentionLayer (plan.attention_layer(name)) instead of its bare "
            "view, or give sliding_window / attention_chunk_size."
        )
    if not isinstance(view, KVCacheView):
        raise TypeError(
            "paged_attention: view must be an attention layer's KVCacheView or "
            f"AttentionLayer, got {type(view).__name__} (a Mamba layer's state "
            "view has no keys)."
        )
    if query_tile is None:
        query_tile = 16 if q.shape[0] > meta.max_reqs else 1
    check_pools_alive(pools, "paged_attention")
    check_layer(layer, view, pools, "paged_attention")
    return _paged_attention(
        q,
        pools,
        view,
        meta,
        layer,
        scale=scale,
        sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size,
        logits_soft_cap=logits_soft_cap,
        cross_attention=bool(cross_attention),
        use_mm_prefix=use_mm_prefix,
        pages_per_chunk=pages_per_chunk,
        query_tile=query_tile,
    )


class _Mask(NamedTuple):
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


class _Rows(NamedTuple):
    """Query rows: each row holds up to `tile` query tokens of one request."""

    req: jax.Array  # (rows,) the row's request
    tok: jax.Array  # (rows, tile) token ids, -1 = empty slot
    valid: jax.Array  # (rows, tile)
    pos: jax.Array  # (rows, tile) the tokens' positions
    kv_len: jax.Array  # (rows,) keys the row's request has
    table: jax.Array  # (rows, num_chunks * chunk) the request's pages, padded


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "sliding_window",
        "attention_chunk_size",
        "logits_soft_cap",
        "cross_attention",
        "use_mm_prefix",
        "pages_per_chunk",
        "query_tile",
    ),
)
def _paged_attention(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: jax.Array | None,
    *,
    scale: float,
    sliding_window: int | None,
    attention_chunk_size: int | None,
    logits_soft_cap: float | None,
    cross_attention: bool,
    use_mm_prefix: bool,
    pages_per_chunk: int,
    query_tile: int,
) -> jax.Array:
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = view.shape[view.dim("head")] if "head" in view.axes else 1
    if num_heads % kv_heads:
        raise ValueError(
            f"q has {num_heads} heads, not a multiple of the view's {kv_heads} KV "
            "heads."
        )
    if head_dim != (view.head_size or head_dim) and "kv" in view.axes:
        raise ValueError(f"q.shape[-1]={head_dim}, but the keys have {view.head_size}.")
    opts = _Mask(
        meta.causal,
        sliding_window,
        attention_chunk_size,
        cross_attention,
        use_mm_prefix,
    )
    groups = num_heads // kv_heads
    head_dim_v = _value_dim(view, head_dim)
    cols = meta.block_table_tensor.shape[1]
    chunk = max(1, min(pages_per_chunk, cols))
    num_chunks = -(-cols // chunk)
    span = chunk * view.block_size
    rows = _query_rows_of(meta, num_tokens, query_tile, opts, num_chunks * chunk)
    safe_tok = jnp.where(rows.valid, rows.tok, 0)
    qg = q[safe_tok].reshape(*rows.tok.shape, kv_heads, groups, head_dim)
    qg = qg.astype(jnp.float32)
    first_chunk, trips = _chunk_range(rows, opts, span, num_chunks)
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
        mask = _visible(rows, meta, opts, j)  # (rows, tile, span)
        return _online_softmax_step(carry, qg, k, v, mask, scale, logits_soft_cap)

    shape = (*rows.tok.shape, kv_heads, groups)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim_v), jnp.float32),
    )
    # Under shard_map (check_vma on) the carry must vary over the mesh axes the
    # body's inputs vary over (the pool's, the queries', the metadata's).
    init = _varying_like(init, (q, pools[view.pool], *jax.tree.leaves(meta)))
    _, denom, acc = jax.lax.fori_loop(0, trips, body, init)
    rows_out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    rows_out = rows_out.reshape(*rows.tok.shape, num_heads, head_dim_v)
    out = jnp.zeros((num_tokens, num_heads, head_dim_v), jnp.float32)
    out = out.at[jnp.where(rows.valid, rows.tok, num_tokens)].set(rows_out, mode="drop")
    return out.astype(q.dtype)


def _query_rows_of(
    meta: CommonAttentionMetadata, num_tokens: int, tile: int, opts: _Mask, width: int
) -> _Rows:
    """The step's query rows with their positions, key counts and page tables."""
    row_req, tok = _query_rows(meta, num_tokens, tile)
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
    return _Rows(row_req, tok, valid, pos, kv_len, table)


def _chunk_range(
    rows: _Rows, opts: _Mask, span: int, num_chunks: int
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


def _visible(
    rows: _Rows, meta: CommonAttentionMetadata, opts: _Mask, j: jax.Array
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


def _online_softmax_step(
    carry: tuple[jax.Array, ...],
    qg: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
    logits_soft_cap: float | None,
) -> tuple[jax.Array, ...]:
    """One chunk of keys folded into ``(running max, denominator, numerator)``."""
    top, denom, acc = carry
    # Scores of unseen keys are masked below (a NaN padding key drops out);
    # unseen values are zeroed, as their weight 0 times NaN is NaN.
    seen = jnp.any(mask, axis=1)[:, :, None, None]
    k = k.astype(jnp.float32)
    v = jnp.where(seen, v, 0).astype(jnp.float32)
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
    acc = acc * rescale[..., None] + jnp.einsum("nqhgl,nlhd->nqhgd", weights, v)
    return new_top, denom, acc


def _query_rows(
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


def _value_dim(view: KVCacheView, head_dim: int) -> int:
    """Value head size of a view: D for K/V axes and MLA, Dv for fused K|V."""
    if "head" in view.axes and "kv" not in view.axes:
        return view.shape[view.dim("dim")] - view.head_size
    return head_dim


def _varying_like(values: Any, refs: tuple[Any, ...]) -> Any:
    """`values` cast to vary over every mesh axis some of `refs` vary over.

    Outside ``shard_map`` nothing varies and `values` come back unchanged.
    """
    axes: set[Any] = set()
    for ref in refs:
        axes |= _varying_axes(ref)
    if not axes:
        return values

    def cast(x: jax.Array) -> jax.Array:
        missing = tuple(sorted(axes - _varying_axes(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, values)


def _varying_axes(x: Any) -> set[Any]:
    """Mesh axes `x` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    if manual is not None:
        return set(manual.varying)
    return set(getattr(aval, "vma", None) or ())  # later jax
