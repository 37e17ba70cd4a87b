"""Quantized K/V pages: 8-bit values with their scales, as vLLM stores them.

vLLM's ``KVQuantMode`` (``AttentionSpec.kv_quant_mode``):

- ``"fp8_per_tensor"``: fp8 pages and static scales from the caller
  (``k_scale`` / ``v_scale``, vLLM's ``layer._k_scale``): one per tensor, or
  one per KV head (vLLM's per-attention-head scales, read by XLA's path
  only); a value ``x`` is stored as ``fp8(clip(x / scale))`` and read as
  ``stored * scale``.
- ``"int8_per_token_head"`` / ``"fp8_per_token_head"``: a float32 scale per
  token and head for K and for V, computed as the token is written, as
  vLLM's ``triton_reshape_and_cache_flash_per_token_head_quant`` does:
  ``scale = max(absmax / QMAX, 1e-6)``, ``q = x / scale`` rounded half away
  from zero for int8, clamped to the dtype's range. The scales sit at the
  end of each page, ``(2, block_size, heads)`` float32 (K's, then V's): a
  view of their own (:func:`scale_view`), so every block carries its scales.

Who reads and writes them: :func:`jaxkv.write_kv` quantizes with XLA on
the step's tokens and writes the 8-bit values and scales by XLA's scatter
or, asked for, the native kernel; XLA's path reads every mode in
:func:`jaxkv.paged_attention` (gathers, then dequantizes); the native
XLA:CPU kernel reads every mode with a head axis as stored (a byte a value,
the scales applied to scores and weights); the Pallas GPU and TPU kernels
read fp8 per-tensor pages (converted to bfloat16 in the kernel) and refuse
per-token-head pages, naming why, so ``implementation=None`` picks XLA's
path for those.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxkv.plan import KVCacheView

PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head")
"""The quantization modes whose pages keep a scale per token and head."""


def quant_unfit(view: KVCacheView) -> str | None:
    """Why a kernel that reads no 8-bit pages cannot take `view` (``None``: it can)."""
    if view.kv_quant_mode == "none":
        return None
    return (
        f"{view.kv_quant_mode} pages are read by XLA's path and the native kernel "
        "(fp8 per tensor by the Pallas kernels too), not by this kernel yet"
    )


def qmax(dtype: np.dtype) -> float:
    """The largest value of an 8-bit cache dtype (127 for int8, 448 for e4m3)."""
    if jnp.issubdtype(dtype, jnp.integer):
        return float(jnp.iinfo(dtype).max)
    return float(jnp.finfo(dtype).max)


def scale_view(view: KVCacheView) -> KVCacheView:
    """The per-token-head scales of `view`'s pages, as a K/V view of their own.

    ``(blocks, 2, block_size, heads, 1)`` float32 at the end of each page,
    K's scales then V's: :func:`jaxkv.write_kv` and
    :func:`jaxkv.gather_kv_pages` read and write them as they do K/V.

    Example:
      >>> import jaxkv
      >>> from jaxkv.kv._quant import scale_view
      >>> spec = jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=8,
      ...     head_size=128, dtype="int8", kv_quant_mode="int8_per_token_head")
      >>> backend = jaxkv.AttentionBackend(name="b",
      ...     layout=jaxkv.KVCacheLayout.BLOCKS_FIRST_FUSED)
      >>> cfg = jaxkv.RunnerConfig(layers=(jaxkv.LayerConfig(name="attn",
      ...     spec=spec, backend=backend),))
      >>> view = jaxkv.make_plan(cfg, num_blocks=4).views["attn"]
      >>> s = scale_view(view)
      >>> s.shape, s.strides, s.offset - view.offset  # after 16*8*256 data bytes
      ((4, 2, 16, 8, 1), (8448, 128, 8, 1, 1), 32768)
    """
    if view.kv_quant_mode not in PER_TOKEN_HEAD:
        raise ValueError(f"A {view.kv_quant_mode} view has no per-token-head scales.")
    if "head" not in view.axes:
        raise NotImplementedError(
            f"{view.kv_quant_mode} MLA latents (no head axis): not stored by jaxkv yet."
        )
    if view.layer is not None:
        raise NotImplementedError(
            f"{view.kv_quant_mode} pages in a typed pool: the scales share each "
            "page's bytes, which only word pools (storage='words') address; make "
            "the plan with storage='words'."
        )
    bd = view.axes.index("block")
    page = view.strides[bd] * view.dtype.itemsize
    data = math.prod(d for i, d in enumerate(view.shape) if i != bd)
    data *= view.dtype.itemsize
    blocks, tokens = view.shape[bd], view.shape[view.axes.index("token")]
    heads = view.shape[view.axes.index("head")]
    if view.strides[bd] != max(view.strides) or page < data + 8 * tokens * heads:
        raise ValueError(
            f"A {view.kv_quant_mode} view must have its blocks outermost with room "
            f"for the scales after the data (page {page} bytes, data {data})."
        )
    if (view.offset + data) % 4 or page % 4:
        raise ValueError(
            f"The scales of a {view.kv_quant_mode} page must be 4-byte aligned (page "
            f"{page} bytes, data {data}, offset {view.offset})."
        )
    return KVCacheView(
        pool=view.pool,
        offset=view.offset + data,
        shape=(blocks, 2, tokens, heads, 1),
        strides=(page // 4, tokens * heads, heads, 1, 1),
        dtype=np.float32,
        axes=("block", "kv", "token", "head", "dim"),
        head_size=1,
        word=view.word,
        owned=view.owned,
        groups=view.groups,
    )


def quantize(
    x: jax.Array, view: KVCacheView, scale: ArrayLike | tuple[ArrayLike, ...] | None
) -> tuple[jax.Array, jax.Array | None]:
    """`x` ``(tokens, heads, dim)`` as `view`'s 8-bit values, and its scales.

    Per tensor, the given `scale` (default 1.0) and no scales returned; per
    token and head, ``(tokens, heads)`` float32 scales computed from `x`.
    NaN stays NaN in fp8 (int8 has none: a NaN token-head stores 0 with a
    NaN scale, so it reads back as NaN); Inf saturates to the dtype's range
    per tensor and gives an Inf scale per token and head.
    """
    dtype = view.dtype
    top = qmax(dtype)
    bottom = float(jnp.iinfo(dtype).min) if jnp.issubdtype(dtype, jnp.integer) else -top
    x = x.astype(jnp.float32)
    if view.kv_quant_mode == "fp8_per_tensor":
        s = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
        if s.ndim == 1:  # one static scale per KV head
            if x.ndim != 3 or s.shape[0] != x.shape[1]:
                raise ValueError(
                    f"write_kv: a scale per KV head must have one entry per head "
                    f"of the written K/V ({x.shape[1:-1]} heads), got shape "
                    f"{s.shape}."
                )
            s = s[None, :, None]
        elif s.ndim:
            raise ValueError(
                "write_kv: k_scale / v_scale must be a scalar or one scale per KV "
                f"head, got shape {s.shape}."
            )
        return jnp.clip(x / s, bottom, top).astype(dtype), None
    scales = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / top, 1e-6)
    q = x * (1.0 / scales)[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        q = jnp.where(q >= 0, q + 0.5, q - 0.5)  # half away from zero, then trunc
        q = jnp.where(jnp.isnan(q), 0.0, q)
    return jnp.clip(q, bottom, top).astype(dtype), scales


def dequantize(
    pages: jax.Array, scales: jax.Array | float | tuple[float, ...] | None
) -> jax.Array:
    """8-bit `pages` ``(..., heads, dim)`` as float32 values.

    `scales`: ``(..., heads, 1)`` per token and head, a per-tensor scalar,
    or a tuple of one static scale per head.
    """
    s = jnp.asarray(1.0 if scales is None else scales, jnp.float32)
    if isinstance(scales, tuple):  # (heads,) against (..., heads, dim)
        s = s.reshape((1,) * (pages.ndim - 2) + (-1, 1))
    return pages.astype(jnp.float32) * s


def raw_views(view: KVCacheView) -> tuple[KVCacheView, ...]:
    """The views a block of `view`'s pages is moved through, bytes as stored.

    A quantized view as a plain view of its 8-bit values (read and written
    as they are, not quantized again) and, per token and head, its scales
    (:func:`scale_view`); any other view as it is. Block copies, the host
    tier and ``ServingLoop.resize`` move blocks through these.

    Example:
      >>> import jaxkv
      >>> from jaxkv.kv._quant import raw_views
      >>> cfg = jaxkv.tiny_hybrid_config(kv_quant_mode="int8_per_token_head")
      >>> plan = jaxkv.make_plan(cfg, num_blocks=4)
      >>> data, scales = raw_views(plan.views["layers.0.self_attn"])
      >>> data.kv_quant_mode, data.dtype.name, scales.dtype.name
      ('none', 'int8', 'float32')
    """
    if view.kv_quant_mode == "none":
        return (view,)
    plain = dataclasses.replace(view, kv_quant_mode="none")
    if view.kv_quant_mode in PER_TOKEN_HEAD:
        return (plain, scale_view(view))
    return (plain,)
