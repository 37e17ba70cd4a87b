"""A model's layer pattern as a :class:`RunnerConfig`.

A model's layer pattern ("5 local : 1 global", "recurrent, recurrent,
local") as a :class:`RunnerConfig`, so specs are not written layer by layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv._util import check_positive_int
from jaxkv.config import (
    AttentionBackend,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    LayerConfig,
    MambaSpec,
    RunnerConfig,
    SlidingWindowSpec,
    get_backend,
)
from jaxkv.plan import align_hybrid_block_size

#: Pattern letters: global (full) attention, local (sliding-window)
#: attention, chunked-local attention, recurrent (Mamba-like) state.
PATTERN_LETTERS = {"G": "global", "L": "local", "C": "chunked", "R": "recurrent"}


def parse_pattern(pattern: str | Sequence[str]) -> tuple[str, ...]:
    """The letters of a layer pattern.

    ``"LLLLLG"``, ``"R,R,L"``, ``["R", "L"]``. Spaces, commas and colons separate, case
    is ignored.

    Raises:
      ValueError: If the pattern is empty or holds a letter outside
        :data:`PATTERN_LETTERS`.

    Example:
      >>> import jaxkv
      >>> jaxkv.parse_pattern("r, r, l")
      ('R', 'R', 'L')
    """
    text = pattern if isinstance(pattern, str) else ",".join(pattern)
    letters = tuple(c.upper() for c in text if c not in " ,:;\t")
    bad = sorted({c for c in letters if c not in PATTERN_LETTERS})
    if not letters or bad:
        raise ValueError(
            f"pattern {pattern!r}: expected letters of {sorted(PATTERN_LETTERS)} "
            f"({', '.join(f'{k} = {v}' for k, v in PATTERN_LETTERS.items())}), "
            + (f"got {bad}." if bad else "got none.")
        )
    return letters


def pattern_config(
    pattern: str | Sequence[str],
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: str = "float32",
    block_size: int = 16,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    recurrent_state: tuple[tuple[tuple[int, ...], ...], tuple[str, ...]] | None = None,
    logits_soft_cap: float | None = None,
    attention_backend: str | AttentionBackend = "JAX_PAGED",
    recurrent_backend: str | AttentionBackend = "MAMBA2",
    **runner_kwargs: object,
) -> RunnerConfig:
    """A decoder of `num_layers` layers following `pattern`, repeated.

    Layer ``i`` has kind ``pattern[i % len(pattern)]``: ``G`` full attention,
    ``L`` sliding-window attention over `sliding_window` keys (the query's own
    included: a query at ``p`` sees ``p - W + 1 .. p``), ``C`` chunked-local
    attention in chunks of `attention_chunk_size`, ``R`` a recurrent state of
    `recurrent_state` ``(shapes, dtypes)`` per request (a :class:`MambaSpec`).
    Attention layers are named ``layers.{i}.self_attn``, recurrent ones
    ``layers.{i}.mixer``. A recurrent state is padded to the attention page
    when it fits, so all layers share pools; otherwise the attention block
    size grows until it does (vLLM's hybrid alignment).

    Args:
      pattern: Layer kinds, e.g. ``"LLLLLG"`` (Gemma-3), ``"RRL"`` (Griffin).
      num_layers: Layers in all.
      num_heads: Query heads per attention layer.
      num_kv_heads: KV heads per attention layer.
      head_size: Head size.
      dtype: The KV cache's dtype.
      block_size: Tokens per block.
      sliding_window: The window of ``L`` layers.
      attention_chunk_size: The chunk of ``C`` layers.
      recurrent_state: ``(shapes, dtypes)`` of an ``R`` layer's state.
      logits_soft_cap: Every attention layer's soft cap (Gemma-2).
      attention_backend: Backend of attention layers.
      recurrent_backend: Backend of recurrent layers.
      **runner_kwargs: The rest of :class:`RunnerConfig` (``max_model_len``,
        ``max_num_seqs``, ``max_num_batched_tokens``, buckets).

    Raises:
      ValueError: If a letter's parameter is missing (``L`` without
        `sliding_window`, ...) or given without a layer that uses it.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.pattern_config("LLLLLG", num_layers=12, num_heads=8,
      ...     num_kv_heads=4, head_size=32, sliding_window=512)
      >>> "".join("G" if type(x.spec) is jaxkv.FullAttentionSpec else "L"
      ...         for x in cfg.layers)
      'LLLLLGLLLLLG'
      >>> griffin = jaxkv.pattern_config("RRL", num_layers=6, num_heads=4,
      ...     num_kv_heads=1, head_size=64, sliding_window=2049,
      ...     recurrent_state=(((3, 256), (256,)), ("float32", "float32")))
      >>> [x.name for x in griffin.layers][:3]
      ['layers.0.mixer', 'layers.1.mixer', 'layers.2.self_attn']
    """
    letters = parse_pattern(pattern)
    used = set(letters)
    for name, value in (
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
    ):
        check_positive_int("pattern_config", name, value)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"pattern_config: num_heads={num_heads} is not a multiple of "
            f"num_kv_heads={num_kv_heads} (each KV head serves the same number "
            "of query heads)."
        )
    for letter, name, value in (
        ("L", "sliding_window", sliding_window),
        ("C", "attention_chunk_size", attention_chunk_size),
        ("R", "recurrent_state", recurrent_state),
    ):
        if (letter in used) != (value is not None):
            raise ValueError(
                f"pattern_config: {name}={value!r} "
                + (
                    f"is needed by the {PATTERN_LETTERS[letter]} ({letter}) layers "
                    f"of {pattern!r}."
                    if value is None
                    else f"is given, but {pattern!r} has no {letter} layer."
                )
            )
    kw = dict(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
    )
    full = FullAttentionSpec(**kw)  # pyright: ignore[reportArgumentType]
    specs: dict[str, KVCacheSpec] = {"G": full}
    if sliding_window is not None:
        specs["L"] = SlidingWindowSpec(sliding_window=sliding_window, **kw)  # pyright: ignore[reportArgumentType]
    if attention_chunk_size is not None:
        specs["C"] = ChunkedLocalAttentionSpec(
            attention_chunk_size=attention_chunk_size,
            **kw,  # pyright: ignore[reportArgumentType]
        )
    fits = True
    if recurrent_state is not None:
        shapes, dtypes = recurrent_state
        state = MambaSpec(block_size=block_size, shapes=shapes, dtypes=dtypes)
        fits = used == {"R"} or state.real_page_size_bytes <= full.page_size_bytes
        if fits and used != {"R"}:
            state = dataclasses.replace(state, page_size_padded=full.page_size_bytes)
        specs["R"] = state
    attn, rec = get_backend(attention_backend), get_backend(recurrent_backend)
    layers = []
    for i in range(num_layers):
        letter = letters[i % len(letters)]
        recurrent = letter == "R"
        layers.append(
            LayerConfig(
                name=f"layers.{i}.{'mixer' if recurrent else 'self_attn'}",
                spec=specs[letter],
                backend=rec if recurrent else attn,
                num_heads=num_heads,
                logits_soft_cap=None if recurrent else logits_soft_cap,
            )
        )
    cfg = RunnerConfig(layers=tuple(layers), **runner_kwargs)  # pyright: ignore[reportArgumentType]
    return cfg if fits else align_hybrid_block_size(cfg).runner_config
