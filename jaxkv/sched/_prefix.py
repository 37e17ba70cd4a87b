"""Prefix caching: chained block hashes and each group kind's longest hit.

Prefix caching: chained hashes of full token blocks and the longest cached
prefix each kind of KV-cache group can reuse (vLLM's per-manager rules); the
block manager (``_manager``) applies them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.config import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    get_num_skipped_tokens,
)
from jaxkv.plan import KVCachePlan

_ROOT = hashlib.sha256(b"jaxkv-prefix-cache-v1").digest()


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    salt: str | None = None,
) -> list[bytes]:
    """SHA-256 hashes of the full blocks of `token_ids`, each chained on the last.

    Block ``j``'s hash covers every token up to the end of block ``j`` (through
    its parent), so equal hashes mean equal prefixes. A trailing partial block
    has no hash.

    Args:
      token_ids: The tokens (prompt, then output).
      block_size: Tokens per block.
      parent: The hash of the block before ``token_ids[0]`` (to extend a chain);
        ``None`` at the start of a request.
      salt: Separates caches (e.g. per tenant or adapter); only used at the
        start of a chain.

    Example:
      >>> import jaxkv
      >>> a = jaxkv.sched.hash_token_blocks([1, 2, 3, 4, 5], 2)
      >>> b = jaxkv.sched.hash_token_blocks([1, 2, 3, 9], 2)
      >>> len(a), a[0] == b[0], a[1] == b[1]
      (2, True, False)
      >>> jaxkv.sched.hash_token_blocks([5], 2, parent=a[1]) == []  # partial: no hash
      True
    """
    if parent is None:
        parent = (
            _ROOT if salt is None else hashlib.sha256(_ROOT + salt.encode()).digest()
        )
    ids = np.asarray(token_ids, np.int64)
    out = []
    for j in range(len(ids) // block_size):
        parent = hashlib.sha256(
            parent + ids[j * block_size : (j + 1) * block_size].tobytes()
        ).digest()
        out.append(parent)
    return out


def longest_cache_hit(
    spec: KVCacheSpec | None,
    *,
    num_blocks: int,
    is_cached: Callable[[int], bool],
) -> int:
    """Largest ``k <= num_blocks`` whose first ``k`` blocks a group can reuse.

    The rule depends on what a query after the hit reads:

    - full attention: blocks ``0..k-1`` all cached;
    - sliding window / chunked local: the blocks still visible from position
      ``k * block_size`` cached (earlier ones become the null block);
    - Mamba: block ``k-1`` cached (its state is the state after ``k`` blocks).

    Args:
      spec: The group's spec; ``None`` for the full-attention rule (a group
        read by a layer with a wider window than its spec's).
      num_blocks: The most blocks that may be reused.
      is_cached: Whether block ``j`` of the request is in the cache.

    Example:
      >>> import jaxkv
      >>> swa = jaxkv.SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8,
      ...     dtype="float32", sliding_window=5)
      >>> cached = {2, 3}.__contains__  # blocks 0 and 1 were evicted
      >>> jaxkv.sched.longest_cache_hit(swa, num_blocks=4, is_cached=cached)
      4
    """
    if isinstance(spec, MambaSpec):
        return next((k for k in range(num_blocks, 0, -1) if is_cached(k - 1)), 0)
    if spec is None:  # full attention: up to the first miss
        return next((j for j in range(num_blocks) if not is_cached(j)), num_blocks)
    # A window: the largest k whose visible blocks [first(k), k) are cached.
    # A miss at m rules out every k > m whose window reaches back to m, and
    # first() never decreases, so the next candidate is k = m: each block is
    # looked up about once, from the end (vLLM's backward scan).
    k = num_blocks
    while k > 0:
        first = get_num_skipped_tokens(spec, k * spec.block_size) // spec.block_size
        miss = next((j for j in range(k - 1, first - 1, -1) if not is_cached(j)), None)
        if miss is None:
            return k
        k = miss
    return 0


def prefix_caching_unsupported(plan: KVCachePlan) -> str | None:
    """Why `plan`'s model cannot use prefix caching, or ``None`` if it can.

    Example:
      >>> import jaxkv
      >>> print(jaxkv.sched.prefix_caching_unsupported(
      ...     jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)))
      None
    """
    for group in plan.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, CrossAttentionSpec | EncoderOnlyAttentionSpec):
            return (
                f"group of {group.layer_names[0]!r} holds {type(spec).__name__} K/V, "
                "computed from encoder inputs, not from the tokens a prefix hash "
                "covers."
            )
    return None
