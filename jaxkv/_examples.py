"""Example runner configurations used by docstrings, tests and the demo."""

from __future__ import annotations

import dataclasses

from jaxkv._pattern import pattern_config
from jaxkv.config import (
    AttentionBackend,
    FullAttentionSpec,
    LayerConfig,
    MambaSpec,
    RunnerConfig,
    SlidingWindowSpec,
    get_backend,
)
from jaxkv.plan import align_hybrid_block_size


def tiny_hybrid_config(
    *,
    num_kv_heads: int = 2,
    head_size: int = 32,
    num_heads: int = 4,
    block_size: int = 32,
    sliding_window: int = 64,
    dtype: str = "float32",
    kv_sharing_fast_prefill: bool = True,
    attention_backend: str | AttentionBackend = "JAX_PAGED",
    kv_quant_mode: str = "none",
    **runner_kwargs: object,
) -> RunnerConfig:
    """The built-in small hybrid model: attention, sliding window, Mamba and YOCO.

    Eight layers: ``0`` full, ``1`` sliding window, ``2`` Mamba, ``3`` full,
    ``4`` sliding window, ``5`` Mamba, then ``6`` and ``7`` reading the caches of
    ``3`` and ``4`` (the YOCO cross-decoder, eligible for fast prefill). The
    Mamba page is padded to the attention page so all three share pools.
    `kv_quant_mode` (:data:`jaxkv.config.KV_QUANT_MODES`) gives the attention
    layers 8-bit pages (``int8`` for int8 per token and head, else
    ``float8_e4m3fn``); the Mamba states keep `dtype`.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> [layer.name for layer in cfg.layers][-2:]
      ['layers.6.self_attn', 'layers.7.self_attn']
      >>> cfg.layer("layers.2.mixer").spec.page_size_bytes
      16384
    """
    attn = get_backend(attention_backend)
    kv_dtype = {"none": dtype, "int8_per_token_head": "int8"}.get(
        kv_quant_mode, "float8_e4m3fn"
    )
    full = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=kv_dtype,
        kv_quant_mode=kv_quant_mode,
    )
    swa = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=kv_dtype,
        sliding_window=sliding_window,
        kv_quant_mode=kv_quant_mode,
    )
    hidden = num_heads * head_size
    mamba = MambaSpec(
        block_size=block_size,
        shapes=((3, hidden), (num_heads, head_size, 16)),
        dtypes=(dtype, "float32"),
        shard_axes=(1, 0),  # channels of the conv state, heads of the SSM state
    )
    # The Mamba page is padded to the attention page so both share pools; if
    # the state does not fit an attention page, the attention block size is
    # raised until it does (vLLM's hybrid alignment, below).
    fits = mamba.real_page_size_bytes <= full.page_size_bytes
    if fits:
        mamba = dataclasses.replace(mamba, page_size_padded=full.page_size_bytes)
    kinds = [
        ("self_attn", full, None),
        ("self_attn", swa, None),
        ("mixer", mamba, None),
        ("self_attn", full, None),
        ("self_attn", swa, None),
        ("mixer", mamba, None),
        ("self_attn", full, "layers.3.self_attn"),
        ("self_attn", swa, "layers.4.self_attn"),
    ]
    layers = [
        LayerConfig(
            name=f"layers.{i}.{kind}",
            spec=spec,
            backend=get_backend("MAMBA2") if isinstance(spec, MambaSpec) else attn,
            kv_sharing_target=target,
            num_heads=num_heads,
        )
        for i, (kind, spec, target) in enumerate(kinds)
    ]
    cfg = RunnerConfig(
        layers=tuple(layers),
        kv_sharing_fast_prefill=kv_sharing_fast_prefill,
        **runner_kwargs,  # pyright: ignore[reportArgumentType]
    )
    return cfg if fits else align_hybrid_block_size(cfg).runner_config


def llama_like_config(
    *,
    num_layers: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    num_heads: int | None = None,
    block_size: int = 16,
    dtype: str = "float32",
    sliding_window: int | None = None,
    window_every: int = 0,
    attention_backend: str | AttentionBackend = "JAX_PAGED_FUSED",
    **runner_kwargs: object,
) -> RunnerConfig:
    """A decoder of `num_layers` attention layers (GQA), Llama-like or Gemma-like.

    With `sliding_window` and ``window_every=n``, every layer but each n-th is
    a sliding-window layer (Gemma-3's 5 local : 1 global with ``n=6``). The
    default backend lays each layer out as vLLM 0.33's default ``LBNHC`` (K and
    V side by side per token and head), which typed pools hold as
    ``(L, num_blocks, block_size, H, 2D)``. `num_heads` defaults to
    ``max(4, num_kv_heads)`` query heads.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.llama_like_config(num_layers=6, sliding_window=32,
      ...                               window_every=3)
      >>> [type(layer.spec).__name__[:7] for layer in cfg.layers][:3]
      ['Sliding', 'Sliding', 'FullAtt']
    """
    local = sliding_window is not None and window_every > 1
    pattern = "L" * (window_every - 1) + "G" if local else "G"
    return pattern_config(
        pattern,
        num_layers=num_layers,
        num_heads=max(4, num_kv_heads) if num_heads is None else num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        sliding_window=sliding_window if local else None,
        attention_backend=attention_backend,
        **runner_kwargs,  # pyright: ignore[reportArgumentType]
    )
