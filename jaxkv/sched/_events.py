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

MEDIUM_GPU = "GPU"
"""The medium of blocks in device pools (vLLM's ``MEDIUM_GPU``: the
accelerator's memory, whatever the accelerator)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Blocks that entered the prefix cache: one block of one group per event.

    Attributes:
      block_hashes: The blocks' hashes (one per block, vLLM's list form).
      parent_block_hash: The hash of the block before the first, or ``None``
        for a prompt's first block.
      token_ids: The tokens the blocks hold.
      block_size: Tokens per block.
      lora_id: Always ``None`` (no LoRA in jaxkv).
      medium: ``"GPU"`` (device pools).
      lora_name: Always ``None``.
      group_idx: The KV-cache group.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    group_idx: int | None = None


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


def external_block_hash(block_hash: bytes) -> int:
    """A block hash as the 64-bit integer vLLM publishes.

    With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the last 8 bytes, big-endian.

    Example:
      >>> import jaxkv
      >>> jaxkv.sched.external_block_hash(bytes(24) + (5).to_bytes(8, "big"))
      5
    """
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)
