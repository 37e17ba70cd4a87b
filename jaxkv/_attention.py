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

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from jaxkv._attention_native import native_decode, native_unfit
from jaxkv._attention_rows import (
    Mask,
    chunk_range,
    online_softmax_step,
    query_rows_of,
    value_dim,
    varying_like,
    visible,
)
from jaxkv._native import by_default as native_by_default
from jaxkv._native import unavailable_reason
from jaxkv.cache import (
    AttentionLayer,
    KVCacheView,
    LayerView,
    Pools,
    check_fits,
    check_layer,
    check_pools_alive,
    gather_kv_pages,
)
from jaxkv.step import CommonAttentionMetadata


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
    pages_per_chunk: int | None = None,
    query_tile: int | None = None,
    layer: Int[ArrayLike, ""] | None = None,
    contraction: str = "auto",
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
        chunks holding keys a row can see are visited, and a table that fits
        one chunk is read in one pass with no loop. Default
        (:func:`auto_pages_per_chunk`): 4 on CPU, 64 elsewhere.
      query_tile: Query tokens of one request that share one read of its
        pages. 1 suits decode batches; prefill chunks want 8-32 (each request
        then costs at most one partly empty tile). Default: 16 when the bucket
        holds more tokens than requests (prefill chunks), else 1.
      layer: For a layer-stacked typed pool: the layer slot to read, possibly
        traced (``lax.scan`` over the layers of one stack, with `view` any
        of them: they share one view but for the slot); ``None``: the view's.
      contraction: How queries meet keys and weights meet values: ``"dot"``
        (dot products: matrix units), ``"reduce"`` (a broadcast multiply and
        a sum that XLA fuses with the page gather, so no gathered chunk is
        written out), or ``"auto"``: ``"reduce"`` on CPU for rows of more
        than one query token, ``"dot"`` otherwise. Measured on XLA:CPU
        (``benchmarks/bench_attention.py``): a mixed batch of 884 tokens in
        rows of 16 takes 26-39 ms reduced against 60-83 ms as dots, while a
        decode batch (rows of 1) takes about twice as long reduced.
        ``"native"``: rows of one token over float32 or bfloat16 K/V (word,
        typed or bits pools) run as one C++ custom call on XLA:CPU
        (``jaxkv/_native``, compiled on first use) that reads each key and
        value once in place; ``"auto"``
        picks it for decode rows it fits in a process with one CPU device
        (a custom call cannot be split by the SPMD partitioner, so with more
        devices XLA's path is kept). All give the same result up to float
        rounding.

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
    opts = Mask(
        meta.causal,
        sliding_window,
        attention_chunk_size,
        bool(cross_attention),
        use_mm_prefix,
    )
    contraction = resolve_contraction(
        contraction, query_tile, native=native_unfit(view, opts, query_tile)
    )
    check_pools_alive(pools, "paged_attention")
    check_fits(pools, view)  # the native kernel reads these bytes directly
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
        contraction=contraction,
    )


def resolve_contraction(
    contraction: str, query_tile: int, *, native: str | None = "no view given"
) -> str:
    """What `contraction` means for rows of `query_tile` tokens here.

    Args:
      contraction: One of :data:`CONTRACTIONS`.
      query_tile: Query tokens per row.
      native: Why the native kernel cannot run this call
        (:func:`jaxkv._attention_native.native_unfit`); ``None``: it can.

    Returns:
      ``"dot"``, ``"reduce"`` or ``"native"``. ``"auto"`` is ``"native"`` for
      rows of one token that the kernel fits, in a process with one CPU device
      and the kernel built; else ``"reduce"`` on CPU for rows of more than one
      token, ``"dot"`` otherwise.

    Raises:
      ValueError: For a name not in :data:`CONTRACTIONS`, or ``"native"`` for a
        call the kernel cannot run (the reason named).

    Example:
      >>> import jax
      >>> from jaxkv._attention import resolve_contraction
      >>> cpu = jax.default_backend() == "cpu"
      >>> resolve_contraction("auto", 16) == ("reduce" if cpu else "dot")
      True
      >>> resolve_contraction("auto", 1), resolve_contraction("reduce", 1)
      ('dot', 'reduce')
    """
    if contraction not in CONTRACTIONS:
        raise ValueError(
            f"paged_attention: contraction={contraction!r}, expected one of "
            f"{CONTRACTIONS}."
        )
    if contraction == "native":
        reason = native if native is not None else unavailable_reason()
        if reason is not None:
            raise ValueError(
                f"paged_attention: contraction='native' cannot run this call: {reason}."
            )
        return contraction
    if contraction != "auto":
        return contraction
    if query_tile == 1 and native is None and native_by_default():
        return "native"
    return "reduce" if query_tile > 1 and jax.default_backend() == "cpu" else "dot"


CONTRACTIONS = ("auto", "dot", "reduce", "native")


def auto_pages_per_chunk() -> int:
    """Pages per chunk that ``pages_per_chunk=None`` means on this platform.

    4 on CPU, 64 elsewhere. Measured: on XLA:CPU the page gather costs about
    1 ns per element (``benchmarks/bench_attention.py``, ``bench_serve.py``),
    so chunks past a row's context cost more than the loop's trips (a
    16-request decode at context 33 over 6 pages: 0.72-0.82 ms a step with 4
    pages per chunk, 0.95-1.0 ms with all 6 in one pass; decode 32 x 512
    is level from 2 to 8 and slower past); on an H200, decode 256 x 4096 in
    bf16 took 2.28 ms with 64 pages per chunk against 3.97 ms with 4.

    Example:
      >>> import jax
      >>> from jaxkv._attention import auto_pages_per_chunk
      >>> auto_pages_per_chunk() == (4 if jax.default_backend() == "cpu" else 64)
      True
    """
    return 4 if jax.default_backend() == "cpu" else 64


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
        "contraction",
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
    pages_per_chunk: int | None,
    query_tile: int,
    contraction: str,
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
    opts = Mask(
        meta.causal,
        sliding_window,
        attention_chunk_size,
        cross_attention,
        use_mm_prefix,
    )
    if contraction == "native":
        return native_decode(
            q,
            pools,
            view,
            meta,
            layer,
            opts=opts,
            scale=scale,
            logits_soft_cap=logits_soft_cap,
        )
    groups = num_heads // kv_heads
    head_dim_v = value_dim(view, head_dim)
    cols = meta.block_table_tensor.shape[1]
    if pages_per_chunk is None:
        pages_per_chunk = auto_pages_per_chunk()
    chunk = max(1, min(pages_per_chunk, cols))
    num_chunks = -(-cols // chunk)
    span = chunk * view.block_size
    rows = query_rows_of(meta, num_tokens, query_tile, opts, num_chunks * chunk)
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
