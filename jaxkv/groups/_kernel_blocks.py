"""Kernel block sizes: choosing them, mapping manager blocks onto them (§1.6, §1.8)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

from jaxkv.config import (
    AttentionBackend,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
    MultipleOf,
    representative_spec,
)

_A = TypeVar("_A", np.ndarray, Any)


def select_common_block_size(
    block_size: int, backends: Sequence[AttentionBackend]
) -> int:
    """Largest kernel block size that divides `block_size` and every backend accepts.

    Rule (spec §1.6): `block_size` itself if every backend accepts it; else the
    largest explicit int declared by any backend that divides `block_size` and
    that every backend accepts.

    Args:
      block_size: The manager block size ``B``.
      backends: Backends that must all accept the result.

    Returns:
      The kernel block size ``k`` (``k`` divides ``B``).

    Raises:
      ValueError: Naming each backend and its declared sizes when none fits.

    Example:
      >>> import jaxkv
      >>> fa, fi = jaxkv.get_backend("FLASH_ATTN"), jaxkv.get_backend("FLASHINFER")
      >>> jaxkv.vllm.select_common_block_size(80, [fa, fi])
      16
      >>> jaxkv.vllm.select_common_block_size(64, [fa, fi])
      64
    """
    if all(b.supports_block_size(block_size) for b in backends):
        return block_size
    candidates = sorted(
        {
            size
            for b in backends
            for size in b.supported_kernel_block_sizes
            if not isinstance(size, MultipleOf) and block_size % size == 0
        },
        reverse=True,
    )
    for size in candidates:
        if all(b.supports_block_size(size) for b in backends):
            return size
    declared = "; ".join(
        f"{b.class_name}: {list(b.supported_kernel_block_sizes)}" for b in backends
    )
    raise ValueError(
        f"No kernel block size divides block_size={block_size} and is accepted by "
        f"every backend ({declared}); choose another block size."
    )


def kernel_block_sizes_by_group(
    kv_cache_config: KVCacheConfig, kernel_block_sizes: Sequence[int]
) -> dict[int, int]:
    """``group id -> kernel block size`` from vLLM's list.

    vLLM's list (:func:`prepare_kernel_block_sizes`) has no entry for
    encoder-only groups, so indexing it by group id gives a later group's
    size to a group after an encoder-only one. A list of one entry per group
    (or any other length: a hand-built config, groups not listed) is taken
    by group id, as vLLM's ``gid < len`` guard reads it.

    Example:
      >>> import jaxkv
      >>> kw = dict(block_size=32, num_kv_heads=1, head_size=8, dtype="float32")
      >>> specs = [jaxkv.EncoderOnlyAttentionSpec(**kw), jaxkv.FullAttentionSpec(**kw)]
      >>> cfg = jaxkv.vllm.KVCacheConfig(num_blocks=2, kv_cache_tensors=[],
      ...     kv_cache_groups=[jaxkv.vllm.KVCacheGroupSpec(layer_names=[str(i)],
      ...                      kv_cache_spec=s) for i, s in enumerate(specs)])
      >>> jaxkv.groups.kernel_block_sizes_by_group(cfg, [16])
      {1: 16}
    """
    sizes = list(kernel_block_sizes)
    groups = kv_cache_config.kv_cache_groups
    kept = [
        gid
        for gid, group in enumerate(groups)
        if not isinstance(
            representative_spec(group.kv_cache_spec), EncoderOnlyAttentionSpec
        )
    ]
    if len(sizes) == len(kept):
        return dict(zip(kept, sizes, strict=True))
    return dict(enumerate(sizes))


def _xp(x: Any) -> Any:
    return np if isinstance(x, np.ndarray) else jnp


def expand_block_table(
    block_table: _A,
    block_size: int,
    kernel_block_size: int,
    kernel_block_stride: int = 0,
) -> _A:
    """Maps a manager block table to kernel block ids (spec §1.6).

    ``out[i, c*r + j] = table[i, c] * (s or r) + j`` with ``r = B // k``.
    NumPy in, NumPy out (host side); JAX in, JAX out (jittable).

    Args:
      block_table: ``(rows, cols)`` int32 manager block ids.
      block_size: Manager block size ``B``.
      kernel_block_size: Kernel block size ``k``; must divide ``B``.
      kernel_block_stride: ``s`` for packed pools (spec §1.8), else 0.

    Returns:
      ``(rows, cols * r)`` int32 kernel block ids.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> jaxkv.groups.expand_block_table(np.array([[2, 5]], np.int32), 32, 16)
      array([[ 4,  5, 10, 11]], dtype=int32)
      >>> jaxkv.groups.expand_block_table(np.array([[2, 5]], np.int32), 32, 16, 3)
      array([[ 6,  7, 15, 16]], dtype=int32)
    """
    r, t = _ratio(block_size, kernel_block_size, kernel_block_stride)
    xp = _xp(block_table)
    table = xp.asarray(block_table, dtype=xp.int32)
    offsets = xp.arange(r, dtype=xp.int32).reshape((1,) * table.ndim + (r,))
    out = table[..., None] * t + offsets
    return out.reshape(*table.shape[:-1], table.shape[-1] * r)


def map_slot_mapping_to_kernel(
    slot_mapping: _A,
    block_size: int,
    kernel_block_size: int,
    kernel_block_stride: int = 0,
) -> _A:
    """Maps manager slots ``b*B + o`` to kernel slots (spec §1.6, inferred formula).

    ``(b*t + o // k) * k + o % k`` with ``t = s or r``; identity when ``s == 0``.
    Negative (padding) slots are kept unchanged.

    Example:
      >>> import numpy as np
      >>> import jaxkv
      >>> from jaxkv.groups import map_slot_mapping_to_kernel
      >>> map_slot_mapping_to_kernel(np.array([33, -1, 70], np.int32), 32, 16, 3)
      array([ 49,  -1, 102], dtype=int32)
    """
    r, t = _ratio(block_size, kernel_block_size, kernel_block_stride)
    xp = _xp(slot_mapping)
    slots = xp.asarray(slot_mapping, dtype=xp.int32)
    block, offset = slots // block_size, slots % block_size
    mapped = (block * t + offset // kernel_block_size) * kernel_block_size + (
        offset % kernel_block_size
    )
    return xp.where(slots < 0, slots, mapped).astype(xp.int32)


def _ratio(block_size: int, kernel_block_size: int, stride: int) -> tuple[int, int]:
    if kernel_block_size <= 0 or block_size % kernel_block_size:
        raise ValueError(
            f"block_size={block_size} is not a multiple of "
            f"kernel_block_size={kernel_block_size}."
        )
    r = block_size // kernel_block_size
    if stride < 0 or (stride and stride < r):
        raise ValueError(
            f"kernel_block_stride={stride} must be 0 or at least B // k = {r}."
        )
    return r, (stride if stride > 0 else r)
