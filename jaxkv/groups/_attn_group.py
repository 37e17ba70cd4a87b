"""AttentionGroup: layers of one KV-cache group sharing backend, spec and head count."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from jaxkv.config import AttentionBackend, KVCacheSpec
from jaxkv.groups._kernel_blocks import expand_block_table, map_slot_mapping_to_kernel


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class AttentionGroup:
    """Layers of one KV-cache group that can share one metadata builder.

    Identity, not value, equality (as in vLLM). ``kernel_block_size is None``
    means kernel blocks equal manager blocks.

    Args:
      backend: The group's backend.
      layer_names: Layers, in group order.
      kv_cache_spec: The per-layer spec (unwrapped from a group wrapper).
      kv_cache_group_id: Index of the KV-cache group.
      kernel_block_size: Tokens per kernel block when smaller than the spec's
        block size, else ``None``.
      kernel_block_stride: ``s`` of a packed pool's kernel view (spec §1.8), else 0.
      num_heads: Query heads of the layers (0 if unknown).
      maps_slot_mapping: Whether this group's slot mappings are converted to
        kernel space by the caller (spec §2.7.5).
      fast_prefill: Whether the layers run on the KV-sharing fast-prefill path
        (YOCO early exit) and so get the reduced metadata record (spec §2.17).

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> spec = jaxkv.FullAttentionSpec(block_size=32, num_kv_heads=1,
      ...     head_size=8, dtype="float32")
      >>> g = jaxkv.vllm.AttentionGroup(backend=jaxkv.get_backend("FLASH_ATTN"),
      ...     layer_names=("a",), kv_cache_spec=spec, kv_cache_group_id=0,
      ...     kernel_block_size=16)
      >>> g.map_to_kernel_block_table(np.array([[2, 5]], np.int32))
      array([[ 4,  5, 10, 11]], dtype=int32)
    """

    backend: AttentionBackend
    layer_names: Sequence[str]
    kv_cache_spec: KVCacheSpec
    kv_cache_group_id: int
    kernel_block_size: int | None = None
    kernel_block_stride: int = 0
    num_heads: int = 0
    maps_slot_mapping: bool = False
    fast_prefill: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        k = self.kernel_block_size
        block_size = self.kv_cache_spec.block_size
        if k is not None:
            if not isinstance(k, int) or k <= 0 or block_size % k:
                raise ValueError(
                    f"AttentionGroup {list(self.layer_names)}: block_size="
                    f"{block_size} is not a multiple of kernel_block_size={k!r}."
                )
            if not self.backend.supports_block_size(k):
                raise ValueError(
                    f"AttentionGroup {list(self.layer_names)}: "
                    f"{self.backend.class_name} does not accept kernel block size "
                    f"{k}; it declares "
                    f"{list(self.backend.supported_kernel_block_sizes)}."
                )

    @property
    def block_size(self) -> int:
        """Manager block size ``B`` of the group."""
        return self.kv_cache_spec.block_size

    @property
    def effective_kernel_block_size(self) -> int:
        """``k``: the kernel block size, or ``B`` when not split."""
        return self.kernel_block_size or self.block_size

    @property
    def blocks_per_kernel_block(self) -> int:
        """``r = B // k``."""
        return self.block_size // self.effective_kernel_block_size

    def map_to_kernel_block_table(self, block_table: Any) -> Any:
        """Expands a manager block table to this group's kernel block ids."""
        if self.kernel_block_size is None:
            return block_table
        return expand_block_table(
            block_table,
            self.block_size,
            self.kernel_block_size,
            self.kernel_block_stride,
        )

    def map_to_kernel_slot_mapping(self, slot_mapping: Any) -> Any:
        """Maps manager slots to this group's kernel slots (padding stays -1)."""
        if self.kernel_block_size is None:
            return slot_mapping
        return map_slot_mapping_to_kernel(
            slot_mapping,
            self.block_size,
            self.kernel_block_size,
            self.kernel_block_stride,
        )

    def __repr__(self) -> str:
        k = (
            f", kernel_block_size={self.kernel_block_size}"
            if self.kernel_block_size
            else ""
        )
        return (
            f"AttentionGroup({self.backend.class_name}, {list(self.layer_names)}, "
            f"group={self.kv_cache_group_id}, {type(self.kv_cache_spec).__name__}"
            f"(block_size={self.block_size}), num_heads={self.num_heads}{k})"
        )


def flat_groups(groups: Iterable[Any]) -> list[AttentionGroup]:
    """Attention groups from a flat or a per-KV-cache-group nested sequence.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> [len(g) for g in plan.attn_groups]  # per KV-cache group
      [2, 2, 1]
      >>> len(jaxkv.groups.flat_groups(plan.attn_groups))
      5
    """
    flat: list[AttentionGroup] = []
    for item in groups:
        if isinstance(item, AttentionGroup):
            flat.append(item)
        else:
            flat.extend(item)
    return flat
