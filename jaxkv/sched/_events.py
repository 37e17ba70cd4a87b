"""KV-cache events for KV-aware routers.

vLLM's ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``
(``vllm/distributed/kv_events.py``), same names and fields, as plain frozen
records a router's publisher serializes as it likes.

A router (llm-d, Dynamo) keeps, per engine, the set of block hashes the engine
holds: ``BlockStored`` adds blocks (with their tokens and parent, so the router
can rebuild the prefix chain), ``BlockRemoved`` drops them (evicted, or
registered for a step that never ran), ``AllBlocksCleared`` drops everything.
Hashes are jaxkv's 32-byte block hashes (``vllm.v1.core.kv_cache_utils``'s
bytes form; :func:`external_block_hash` gives vLLM's 64-bit integer form).
"""

from __future__ import annotations

import dataclasses

from jaxkv.config import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

MEDIUM_GPU = "GPU"
"""The medium of blocks in device pools (vLLM's ``MEDIUM_GPU``: the
accelerator's memory, whatever the accelerator)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Blocks that entered the prefix cache, as vLLM's ``cache_full_blocks`` says.

    One event per group each time a request's full blocks are cached (an
    allocation or a commit): the blocks from the last cached one to the last
    full one, as vLLM emits one per ``cache_full_blocks`` call.

    Attributes:
      block_hashes: The hashes of the blocks cached (null blocks, behind a
        window, are skipped: the list may be shorter than the tokens' blocks,
        or empty).
      parent_block_hash: The hash of the block before the first of the range,
        or ``None`` when the range starts at the prompt's first block.
      token_ids: The tokens of every block of the range.
      block_size: Tokens per block.
      lora_id: Always ``None`` (no LoRA in jaxkv).
      medium: ``"GPU"`` (device pools).
      lora_name: Always ``None``.
      group_idx: The KV-cache group.
      kv_cache_spec_kind: The group's spec kind, as vLLM's
        ``get_kv_cache_spec_kind`` names it (``"full_attention"``,
        ``"sliding_window"``, ``"mamba"``, ...).
      kv_cache_spec_sliding_window: The group's window (vLLM's
        ``get_kv_cache_spec_sliding_window``: sliding-window specs only).
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    """Blocks that left the prefix cache (evicted or dropped).

    Attributes:
      block_hashes: The removed blocks' hashes.
      medium: ``"GPU"``.
      group_idx: The KV-cache group.
    """

    block_hashes: tuple[bytes, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was emptied (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
"""One KV-cache event: a block stored, a block removed, or every block cleared."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVEventBatch:
    """The events of one step of one engine, as vLLM publishes them.

    vLLM's ``KVEventBatch`` (``vllm/distributed/kv_events.py``): what a
    ``ServingLoop`` gives its ``kv_event_sink`` after each step, one batch
    per data-parallel rank with events.

    Attributes:
      ts: When the batch was taken (``time.time()``, seconds).
      events: The events, oldest first.
      data_parallel_rank: The rank whose scheduler emitted them (``None``
        on a single rank).
    """

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


def spec_kind(spec: KVCacheSpec) -> tuple[str, int | None]:
    """``(kind, sliding window)`` of a group's spec, as vLLM names them.

    vLLM's ``get_kv_cache_spec_kind`` and ``get_kv_cache_spec_sliding_window``
    (subclasses before their bases).

    Example:
      >>> import jaxkv
      >>> spec = jaxkv.SlidingWindowSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32", sliding_window=64)
      >>> jaxkv.sched.spec_kind(spec)
      ('sliding_window', 64)
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = {spec_kind(s) for s in spec.kv_cache_specs.values()}
        if len(inner) == 1:
            return next(iter(inner))
        windows = {w for _, w in inner}
        kinds = {k for k, _ in inner}
        window = next(iter(windows)) if len(windows) == 1 else None
        return (next(iter(kinds)) if len(kinds) == 1 else "unknown"), window
    kinds = (
        (SlidingWindowMLASpec, "sliding_window_mla"),
        (MLAAttentionSpec, "mla_attention"),
        (FullAttentionSpec, "full_attention"),
        (ChunkedLocalAttentionSpec, "chunked_local_attention"),
        (SlidingWindowSpec, "sliding_window"),
        (MambaSpec, "mamba"),
        (EncoderOnlyAttentionSpec, "encoder_only_attention"),
        (CrossAttentionSpec, "cross_attention"),
    )
    kind = next((name for cls, name in kinds if isinstance(spec, cls)), "unknown")
    windowed = isinstance(spec, SlidingWindowSpec | SlidingWindowMLASpec)
    return kind, spec.sliding_window if windowed else None


def external_block_hash(block_hash: bytes) -> int:
    """A block hash as the 64-bit integer vLLM publishes.

    With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the last 8 bytes, big-endian.

    Example:
      >>> import jaxkv
      >>> jaxkv.sched.external_block_hash(bytes(24) + (5).to_bytes(8, "big"))
      5
    """
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)
