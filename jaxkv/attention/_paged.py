"""``paged_attention``: one entry point, one explicit kernel choice per platform.

The call's options are checked on the host and frozen into a static
:class:`~jaxkv.attention._call.Call`; ``implementation`` then picks the
kernel, per platform: from the pool's device when it is a concrete array,
else with ``jax.lax.platform_dependent`` inside the caller's jit (only the
branch of the platform being compiled for is lowered), never from process
globals.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from jaxkv._util import checks_own_arguments, is_int
from jaxkv.attention._call import Call, head_dims, kv_heads_of
from jaxkv.attention._kernels import ATTENTION_KERNELS, branch
from jaxkv.attention._rows import Mask
from jaxkv.attention._xla import resolve_contraction
from jaxkv.kv import Pools, check_fits, check_layer, check_pools_alive
from jaxkv.plan import AttentionLayer, KVCacheView, LayerView
from jaxkv.step import CommonAttentionMetadata

IMPLEMENTATIONS = ATTENTION_KERNELS.implementations
"""What ``paged_attention(implementation=)`` takes (with jaxkv's own kernels)."""


@checks_own_arguments
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
    implementation: str | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
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
      contraction: On XLA's path, how queries meet keys and weights meet
        values: ``"dot"`` (dot products: matrix units), ``"reduce"`` (a
        broadcast multiply and a sum that XLA fuses with the page gather, so
        no gathered chunk is written out), or ``"auto"``: ``"reduce"`` on
        CPU for rows of more than one query token, ``"dot"`` otherwise.
        On XLA:CPU a mixed batch in rows of 16 runs faster reduced than as
        dots, and a decode batch (rows of 1) slower
        (``benchmarks/bench_attention.py``; figures in its README).
      implementation: Which kernel runs the call (after
        ``jax.nn.dot_product_attention``); every one gives the XLA path's
        result up to float rounding (:data:`IMPLEMENTATIONS`):

        ==============  ====================================================
        ``None``        the best for the platform the call is compiled for
                        (``jax.lax.platform_dependent``, or the pool's own
                        device when it is a concrete array): ``"pallas"``
                        on GPU and TPU where the kernel fits the call
                        (:func:`pallas_unfit`), else ``"xla"``; on CPU
                        ``"xla"`` (the C++ kernel is opt-in)
        ``"xla"``       jaxkv's pure-JAX path, every platform and feature
        ``"pallas"``    jaxkv's Pallas kernel for the platform: Triton on
                        GPU, Mosaic on TPU; on CPU the GPU kernel in
                        Pallas's interpret mode (slow: for tests)
        ``"pallas_gpu"`` / ``"pallas_tpu"``  that kernel; compiled on its
                        own platform, in interpret mode elsewhere
        ``"native"``    jaxkv's C++ XLA:CPU decode kernel (rows of one
                        token; compiled with the machine's C++ compiler on
                        first use and cached, ``jaxkv/_native``); a custom
                        call the SPMD partitioner cannot split, so on a
                        mesh call it inside ``shard_map``
        ==============  ====================================================

        An implementation asked for by name that cannot run this call raises
        a ValueError naming why. Quantized pages (the spec's
        ``kv_quant_mode``) are dequantized by XLA's path, and fp8 pages with
        per-tensor scales by the GPU kernel too (sm_89 and newer).
      k_scale: The static K scale of ``"fp8_per_tensor"`` pages (a Python
        float, vLLM's ``layer._k_scale``; default 1.0): K is read as the
        stored value times it. Or one float per KV head (a sequence or NumPy
        array: vLLM's per-attention-head scales), read by XLA's path (the
        kernels refuse it, naming why). Only for those pages.
      v_scale: The same for V.

    Returns:
      ``(num_tokens, num_heads, head_dim_v)``; zero for padded tokens.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> kv = jaxkv.plan.make_kv_cache_config(cfg, num_blocks=4)
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
    _check_call(q, meta, query_tile=query_tile, pages_per_chunk=pages_per_chunk)
    group = getattr(meta, "group", None)
    if isinstance(view, KVCacheView) and view.groups and group is not None:
        if group not in view.groups:
            raise ValueError(
                f"paged_attention: the view (pool {view.pool}, offset {view.offset}) "
                f"is bound to KV-cache group(s) {list(view.groups)}, but meta is "
                f"group {group}'s (another group's block tables address other "
                "pages); pass the layer (plan.attention_layer(name)) and "
                "builder.metadata(inputs)[name]."
            )
    if isinstance(view, AttentionLayer):
        if None not in (view.group, meta.group) and view.group != meta.group:
            raise ValueError(
                f"paged_attention: layer {view.name!r} reads KV-cache group "
                f"{view.group}'s metadata, but meta is group {meta.group}'s (another "
                "group's block tables address other pages); pass "
                f"builder.metadata(inputs)[{view.name!r}]."
            )
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
    _check_call(q, meta, query_tile=query_tile, pages_per_chunk=pages_per_chunk)
    _check_mask_args(
        sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size,
        logits_soft_cap=logits_soft_cap,
        cross_attention=cross_attention,
        use_mm_prefix=use_mm_prefix,
    )
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating):
        raise TypeError(f"paged_attention: scale must be a number, got {scale!r}.")
    if query_tile is None:
        query_tile = 16 if q.shape[0] > meta.max_reqs else 1
    call = Call(
        mask=Mask(
            meta.causal,
            sliding_window,
            attention_chunk_size,
            bool(cross_attention),
            use_mm_prefix,
        ),
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        pages_per_chunk=pages_per_chunk,
        query_tile=query_tile,
        contraction=contraction,
        k_scale=_static_scale(k_scale, "k_scale", view),
        v_scale=_static_scale(v_scale, "v_scale", view),
    )
    resolve_contraction(contraction, query_tile, platform="cpu")  # a bad name raises
    _check_heads(q.shape, view)
    check_pools_alive(pools, "paged_attention")
    check_fits(pools, view)  # the native kernel reads these bytes directly
    check_layer(layer, view, pools, "paged_attention")
    if q.shape[0] == 0:  # an empty batch: nothing to attend
        _, dv = head_dims(view, q.shape[2])
        return jnp.zeros((0, q.shape[1], dv), q.dtype)
    platform = _platform_of(pools[view.pool])
    choice = choose_implementation(
        implementation, view, call, q.shape, platform=platform
    )
    return _attend(
        q, pools, view, meta, layer, call=call, choice=choice, platform=platform
    )


def _static_scale(
    value: object, name: str, view: KVCacheView
) -> float | tuple[float, ...] | None:
    """Static scales of fp8_per_tensor pages: a float, or one per KV head.

    A scalar is returned as a float; a sequence (or NumPy array) of one
    scale per KV head of `view` as a tuple of floats (static: part of the
    program, as vLLM's per-attention-head scales are checkpoint constants).
    """
    if value is None:
        return None
    if view.kv_quant_mode != "fp8_per_tensor":
        raise ValueError(
            f"paged_attention: {name} is the static scale of fp8_per_tensor pages; "
            f"this view holds {view.kv_quant_mode!r} pages."
        )
    if isinstance(value, bool) or not isinstance(
        value, int | float | np.floating | np.ndarray | list | tuple
    ):
        raise TypeError(
            f"paged_attention: {name} must be a Python float or one float per KV "
            f"head (static scales), got {type(value).__name__}."
        )
    values = np.asarray(value)
    if values.ndim == 0:
        scales: tuple[float, ...] = (float(values),)
    else:
        heads = kv_heads_of(view)
        if values.shape != (heads,) or not np.issubdtype(values.dtype, np.number):
            raise ValueError(
                f"paged_attention: {name} must be a float or one per KV head "
                f"({heads} for this view), got shape {values.shape}."
            )
        scales = tuple(float(x) for x in values)
    if not all(math.isfinite(x) and x > 0 for x in scales):
        raise ValueError(
            f"paged_attention: {name} must be finite and > 0, got {value}."
        )
    return scales[0] if values.ndim == 0 else scales


def _check_call(
    q: object,
    meta: object,
    *,
    query_tile: object,
    pages_per_chunk: object,
) -> None:
    """The call's queries and options, named, before anything is traced."""
    if not isinstance(meta, CommonAttentionMetadata):
        raise TypeError(
            "paged_attention: meta must be the layer's CommonAttentionMetadata "
            f"(builder.metadata(inputs)[name]), got {type(meta).__name__}."
        )
    if not hasattr(q, "shape") or not hasattr(q, "dtype"):
        raise TypeError(f"paged_attention: q must be an array, got {type(q).__name__}.")
    shape = tuple(q.shape)  # pyright: ignore[reportAttributeAccessIssue]
    if len(shape) != 3:
        raise ValueError(
            "paged_attention: q must be (num_tokens, num_heads, head_dim), got "
            f"shape {shape}."
        )
    dtype = np.dtype(q.dtype)  # pyright: ignore[reportAttributeAccessIssue]
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"paged_attention: q has dtype {dtype}; queries are floating point "
            "(an integer q would be attended and truncated)."
        )
    tokens = meta.slot_mapping.shape[0]
    # A fast-prefill (YOCO) layer may attend the logits tokens alone: the
    # reduced record's rows (make_kv_sharing_fast_prefill_common_attn_metadata).
    reduced = meta.logits_indices_padded.shape[0]
    allowed = (tokens, reduced) if meta.fast_prefill else (tokens,)
    if shape[0] not in allowed:
        also = (
            f" or, for a fast-prefill layer, the {reduced} logits tokens"
            if meta.fast_prefill
            else ""
        )
        raise ValueError(
            f"paged_attention: q has {shape[0]} tokens, but meta is for {tokens} "
            f"(its slot_mapping){also}: every token of the step needs its query "
            "row (fewer would drop the last ones' outputs); pass the step's "
            "whole q."
        )
    for name, value, optional in (
        ("query_tile", query_tile, True),
        ("pages_per_chunk", pages_per_chunk, True),
    ):
        if value is None and optional:
            continue
        if not is_int(value) or value < 1:
            raise ValueError(
                f"paged_attention: {name} must be a positive int, got {value!r}."
            )


def _check_mask_args(**given: object) -> None:
    """Windows and chunks positive ints, the cap a positive number, flags bools."""
    for name in ("sliding_window", "attention_chunk_size"):
        value = given[name]
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(
                f"paged_attention: {name} must be None or a positive int, got "
                f"{value!r}."
            )
    cap = given["logits_soft_cap"]
    if cap is not None and (
        isinstance(cap, bool)
        or not isinstance(cap, int | float | np.floating)
        or not cap > 0
    ):
        raise ValueError(
            f"paged_attention: logits_soft_cap must be None or a positive number, "
            f"got {cap!r}."
        )
    for name, optional in (("cross_attention", True), ("use_mm_prefix", False)):
        value = given[name]
        if (value is None and optional) or isinstance(value, bool | np.bool_):
            continue
        raise TypeError(f"paged_attention: {name} must be a bool, got {value!r}.")


def _check_heads(q_shape: tuple[int, ...], view: KVCacheView) -> None:
    _, num_heads, head_dim = q_shape
    kv_heads = kv_heads_of(view)
    if num_heads % kv_heads:
        raise ValueError(
            f"paged_attention: q has {num_heads} heads, not a multiple of the "
            f"view's {kv_heads} KV heads."
        )
    if head_dim != (view.head_size or head_dim) and "kv" in view.axes:
        raise ValueError(
            f"paged_attention: q.shape[-1]={head_dim}, but the keys have "
            f"{view.head_size}."
        )


def _platform_of(pool: object) -> str | None:
    """The platform a concrete pool array lives on (``None`` for a tracer)."""
    if not isinstance(pool, jax.Array):
        return None
    try:
        platform = next(iter(pool.devices())).platform
    except (jax.errors.ConcretizationTypeError, RuntimeError, StopIteration):
        return None  # traced (decided at lowering), or deleted (checked elsewhere)
    return "cuda" if platform == "gpu" else platform


class Choice(NamedTuple):
    """The implementation each platform runs (static, hashable)."""

    by_platform: tuple[tuple[str, str], ...]  # (platform, implementation)
    default: str

    def on(self, platform: str) -> str:
        """The implementation `platform` runs."""
        return dict(self.by_platform).get(platform, self.default)


def choose_implementation(
    implementation: str | None,
    view: KVCacheView,
    call: Call,
    q_shape: tuple[int, ...],
    *,
    platform: str | None = None,
) -> Choice:
    """Which implementation each platform runs for this call.

    Args:
      implementation: One of :data:`IMPLEMENTATIONS`.
      view: The layer's view.
      call: The call's static options.
      q_shape: The queries' shape.
      platform: The platform the pools live on, when known (``"cpu"``,
        ``"cuda"``, ``"rocm"``, ``"tpu"``); ``None``: decided per platform at
        lowering.

    Returns:
      A :class:`Choice`: an implementation per platform.

    Raises:
      ValueError: For an unknown name, or a named implementation that cannot
        run this call (the reason named).

    Example:
      >>> import jaxkv
      >>> from jaxkv.attention._call import Call
      >>> from jaxkv.attention._paged import choose_implementation
      >>> from jaxkv.attention._rows import Mask
      >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=2),
      ...                        num_blocks=4, storage="stacked")
      >>> view = plan.views["layers.0.self_attn"]
      >>> call = Call(Mask(True, None, None, False, False), 1.0, None, None, 1,
      ...             "auto")
      >>> choice = choose_implementation(None, view, call, (8, 4, 32))
      >>> choice.on("cpu"), choice.on("cuda"), choice.on("tpu")
      ('xla', 'pallas_gpu', 'pallas_tpu')
      >>> choose_implementation(None, view, call, (8, 4, 32), platform="cpu")
      Choice(by_platform=(), default='xla')
    """
    platforms = (platform,) if platform is not None else ()
    picks = ATTENTION_KERNELS.pick(
        implementation, view, call, q_shape, platforms=platforms
    )
    names = set(picks.values())
    if len(names) == 1:
        return Choice((), names.pop())
    fallback = ATTENTION_KERNELS.fallback.name
    return Choice(tuple(p for p in picks.items() if p[1] != fallback), fallback)


@functools.partial(jax.jit, static_argnames=("call", "choice", "platform"))
def _attend(
    q: jax.Array,
    pools: Pools,
    view: KVCacheView,
    meta: CommonAttentionMetadata,
    layer: jax.Array | None,
    *,
    call: Call,
    choice: Choice,
    platform: str | None,
) -> jax.Array:
    args = (q, pools, meta, layer)
    if platform is not None:  # the pools' own device
        return branch(choice.on(platform), platform, view, call)(*args)
    # Decided at lowering: only the branch of the platform compiled for is
    # lowered (a device never holds an interpreter loop); equal branches
    # are traced once.
    return jax.lax.platform_dependent(
        *args,
        **{p: branch(choice.on(p), p, view, call) for p in ATTENTION_KERNELS.platforms},
    )
