"""A pure-JAX ragged paged attention that reads K/V through layer views.

Every query token reads the pages of its own request through the layer's view
(``gather_kv_pages``: index arithmetic on the pool, never a pool copy), a chunk
of pages at a time, with an online softmax; the loop stops at the step's
longest context. One kernel covers mixed
prefill/decode batches, GQA, causal, sliding-window and chunked-local masks,
cross-attention over cached encoder K/V, PrefixLM multimodal ranges and
logits soft-capping. Padding pages and padded tokens never reach an output:
masked keys are removed with ``where`` (so NaN pages cannot leak) and tokens
with no visible key produce zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxkv._kv_ops import Pools, gather_kv_pages
from jaxkv._metadata import CommonAttentionMetadata
from jaxkv._views import KVCacheView


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
    ),
)
def paged_attention(
    q: Float[Array, "num_tokens num_heads head_dim"],
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    cross_attention: bool = False,
    use_mm_prefix: bool = False,
    pages_per_chunk: int = 4,
) -> Float[Array, "num_tokens num_heads head_dim_v"]:
    """Attention of a ragged batch over K/V read through a layer's view.

    Args:
      q: ``(num_tokens, num_heads, head_dim)`` queries, ``num_heads`` a multiple
        of the view's KV heads (GQA).
      pools: The pool arrays.
      view: The layer's (bound) view; ``meta.block_table_tensor`` must be in
        its block space (kernel blocks for kernel views).
      meta: The group's step metadata.
      scale: Softmax scale.
      sliding_window: Keys within the last `sliding_window` positions only.
      attention_chunk_size: Keys in the query's chunk only.
      logits_soft_cap: ``cap * tanh(s / cap)`` on the scores.
      cross_attention: Keys are the request's cached encoder K/V
        (``encoder_seq_lens``), no causal mask.
      use_mm_prefix: Tokens inside one multimodal range see each other
        bidirectionally (PrefixLM).
      pages_per_chunk: Pages gathered per step of the online softmax; only the
        chunks up to the step's longest context are visited.

    Returns:
      ``(num_tokens, num_heads, head_dim_v)``; zero for padded tokens.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.make_kv_cache_config(cfg, num_blocks=4)
      >>> groups, _, sizes = jaxkv.init_attn_backend(kv, cfg)
      >>> pools, views = jaxkv.init_kv_cache(kv, cfg, sizes, groups)
      >>> view = views["layers.0.self_attn"]
      >>> k = jnp.arange(2 * 2 * 32, dtype=jnp.float32).reshape(2, 2, 32) / 100
      >>> pools = jaxkv.write_kv(pools, view, k, k + 1, jnp.array([32, 33]))
      >>> meta = jaxkv.build_attn_metadata(groups, 1, 2, jnp.array([0, 2]), None, 2,
      ...     jnp.array([2]), 2, [jnp.array([[1]])] * 3, [jnp.array([32, 33])] * 3,
      ...     kv)["layers.0.self_attn"]
      >>> out = jaxkv.paged_attention(jnp.zeros((2, 4, 32)), pools, view, meta,
      ...                             scale=1.0)
      >>> bool(np.allclose(out[0, 0], k[0, 0] + 1))  # sees only itself
      True
      >>> bool(np.allclose(out[1, 0], k[:, 0].mean(0) + 1))  # zero q: mean of v
      True
    """
    num_tokens, num_heads, head_dim = q.shape
    req, pos, valid_q = token_requests_and_positions(meta, num_tokens)
    table = meta.block_table_tensor[req]  # (T, cols): each token's own pages
    cols = table.shape[1]
    chunk = max(1, min(pages_per_chunk, cols))
    num_chunks = -(-cols // chunk)
    table = jnp.pad(table, ((0, 0), (0, num_chunks * chunk - cols)))
    block = view.block_size
    kv_heads = view.shape[view.dim("head")] if "head" in view.axes else 1
    if num_heads % kv_heads:
        raise ValueError(
            f"q has {num_heads} heads, not a multiple of the view's {kv_heads} KV "
            "heads."
        )
    groups = num_heads // kv_heads
    qg = q.reshape(num_tokens, kv_heads, groups, head_dim).astype(jnp.float32)
    kv_len = meta.encoder_seq_lens[req] if cross_attention else meta.seq_lens[req]
    p = pos[:, None]

    def visible(j: jax.Array) -> jax.Array:
        """(T, span) mask of the keys at absolute positions `j` (1, span)."""
        mask = (j < kv_len[:, None]) & valid_q[:, None]
        if cross_attention:
            return mask
        if meta.causal:
            causal = j <= p
            if use_mm_prefix:
                # Inclusive ranges [s, e]: a query inside one sees the whole range.
                ranges = meta.mm_prefix_ranges[req]  # (T, max_ranges, 2)
                count = meta.mm_num_ranges[req][:, None]
                live = jnp.arange(ranges.shape[1], dtype=jnp.int32)[None, :] < count
                s, e = ranges[..., 0][:, :, None], ranges[..., 1][:, :, None]
                inside_q = (
                    live[:, :, None] & (s <= p[:, :, None]) & (p[:, :, None] <= e)
                )
                inside_k = (s <= j[:, None, :]) & (j[:, None, :] <= e)
                causal = causal | jnp.any(inside_q & inside_k, axis=1)
            mask = mask & causal
        if sliding_window is not None:
            mask = mask & (j > p - sliding_window)
        if attention_chunk_size is not None:
            mask = mask & (j // attention_chunk_size == p // attention_chunk_size)
        return mask

    def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        top, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, c * chunk, chunk, axis=1)
        k_pages, v_pages = gather_kv_pages(pools, view, pages)
        if v_pages is None:  # MLA: the latent is both key and value
            v_pages = k_pages
        k = k_pages.reshape(num_tokens, chunk * block, kv_heads, -1)
        v = v_pages.reshape(num_tokens, chunk * block, kv_heads, -1)
        j = c * chunk * block + jnp.arange(chunk * block, dtype=jnp.int32)[None, :]
        mask = visible(j)
        # Zero masked keys/values first: a NaN padding page times 0 is still NaN.
        k = jnp.where(mask[:, :, None, None], k, 0).astype(jnp.float32)
        v = jnp.where(mask[:, :, None, None], v, 0).astype(jnp.float32)
        scores = jnp.einsum("thgd,tlhd->thgl", qg, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
        m4 = mask[:, None, None, :]
        scores = jnp.where(m4, scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        weights = jnp.where(m4, jnp.exp(scores - safe[..., None]), 0.0)
        rescale = jnp.where(jnp.isfinite(top), jnp.exp(top - safe), 0.0)
        denom = denom * rescale + jnp.sum(weights, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("thgl,tlhd->thgd", weights, v)
        return new_top, denom, acc

    if head_dim != (view.head_size or head_dim) and "kv" in view.axes:
        raise ValueError(f"q.shape[-1]={head_dim}, but the keys have {view.head_size}.")
    head_dim_v = _value_dim(view, head_dim)
    init = (
        jnp.full((num_tokens, kv_heads, groups), -jnp.inf, jnp.float32),
        jnp.zeros((num_tokens, kv_heads, groups), jnp.float32),
        jnp.zeros((num_tokens, kv_heads, groups, head_dim_v), jnp.float32),
    )
    # Only the chunks that hold a visible key of this step are visited.
    longest = jnp.max(jnp.where(valid_q, kv_len, 0))
    trips = jnp.minimum((longest + chunk * block - 1) // (chunk * block), num_chunks)
    _, denom, acc = jax.lax.fori_loop(0, trips, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim_v).astype(q.dtype)


def _value_dim(view: KVCacheView, head_dim: int) -> int:
    """Value head size of a view: D for K/V axes and MLA, Dv for fused K|V."""
    if "head" in view.axes and "kv" not in view.axes:
        return view.shape[view.dim("dim")] - view.head_size
    return head_dim
