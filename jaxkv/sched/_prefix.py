"""Prefix caching: chained hashes of full token blocks, the longest cached
prefix each kind of KV-cache group can reuse (vLLM's per-manager rules), and
the block manager's prefix-cache side (:class:`PrefixHits`).
"""  # noqa: D205

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv._mamba_spec import MambaSpec
from jaxkv._specs import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheSpec,
    get_num_skipped_tokens,
)
from jaxkv.plan import KVCachePlan
from jaxkv.sched._blocks import BlockAllocator
from jaxkv.sched._host_tier import HostKVCache
from jaxkv.sched._request import Request

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
    run = 0  # cached blocks in a row ending at block k - 1
    runs = []
    for j in range(num_blocks):
        run = run + 1 if is_cached(j) else 0
        runs.append(run)
    for k in range(num_blocks, 0, -1):
        first = (
            0
            if spec is None
            else get_num_skipped_tokens(spec, k * spec.block_size) // spec.block_size
        )
        if runs[k - 1] >= k - first:
            return k
    return 0


class PrefixHits:
    """The prefix-cache half of :class:`KVCacheManager`: each request's block
    hashes, the longest hit every group agrees on, and registering the blocks
    a step fills (vLLM's ``allocate_slots``; a Mamba state only once its step
    is committed).
    """  # noqa: D205

    # State owned by KVCacheManager.__init__.
    enable_prefix_caching: bool
    block_sizes: list[int]
    is_mamba: list[bool]
    specs: list[KVCacheSpec | None]
    allocator: BlockAllocator
    host: HostKVCache | None
    _hashes: dict[str, dict[int, list[bytes]]]
    _uncommitted: dict[str, list[int]]
    _pending_states: set[int]

    def _block_hashes(self, req: Request, block_size: int) -> list[bytes]:
        """`req`'s full-block hashes for `block_size`, extended as tokens grow."""
        per = self._hashes.setdefault(req.req_id, {})
        have = per.setdefault(block_size, [])
        # Placeholders of tokens still on the device are never hashed.
        known = req.num_known_tokens
        if known // block_size > len(have):
            start = len(have) * block_size
            have += hash_token_blocks(
                req.token_range(start, known),
                block_size,
                parent=have[-1] if have else None,
                salt=req.cache_salt,
            )
        return have

    def find_cache_hit(self, req: Request) -> int:
        """Tokens of `req` every group can take from the prefix cache (no effect).

        A multiple of every group's block size, below ``len(req.tokens)`` (the
        last token is always computed: its logits are sampled).
        """
        if not self.enable_prefix_caching:
            return 0
        hit = req.num_known_tokens - 1
        while True:
            agreed = hit
            for g, spec in enumerate(self.specs):
                bs = self.block_sizes[g]
                hashes = self._block_hashes(req, bs)
                k = longest_cache_hit(
                    spec,
                    num_blocks=min(agreed // bs, len(hashes)),
                    is_cached=lambda j, g=g, h=hashes: self._is_cached((g, h[j])),
                )
                agreed = k * bs
            if agreed == hit:
                return hit
            hit = agreed

    def _is_cached(self, key: tuple[int, bytes]) -> bool:
        """On the device, or in the host tier (copied back on a hit)."""
        if self.allocator.lookup(key) is not None:
            return True
        return self.host is not None and key in self.host

    def _hit_columns(self, g: int, num_tokens: int) -> list[int]:
        """Columns group `g` reuses for a hit of `num_tokens` (others null)."""
        bs = self.block_sizes[g]
        k = num_tokens // bs
        if k == 0:
            return []
        if self.is_mamba[g]:
            return [k - 1]
        spec = self.specs[g]
        first = 0 if spec is None else get_num_skipped_tokens(spec, num_tokens) // bs
        return list(range(first, k))

    def _hit_tables(
        self, req: Request, num_cached: int
    ) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int, bytes]]] | None:
        """``(tables, hit blocks, host hits)`` per group of a cache hit of
        `num_cached` tokens, or ``None`` while a hit block's Mamba state is
        still pending. Host hits are ``(group, column, hash)`` of blocks only
        the host tier holds (their column is 0 until a block is allocated).
        """  # noqa: D205
        tables: list[list[int]] = []
        hits: list[list[int]] = [[] for _ in self.block_sizes]
        from_host: list[tuple[int, int, bytes]] = []
        for g, bs in enumerate(self.block_sizes):
            hashes = self._block_hashes(req, bs)
            table = [0] * (num_cached // bs)
            for j in self._hit_columns(g, num_cached):
                block = self.allocator.lookup((g, hashes[j]))
                if (
                    block is None
                    and self.host is not None
                    and (g, hashes[j]) in (self.host)
                ):
                    from_host.append((g, j, hashes[j]))
                    continue
                if block is None:
                    raise ValueError(
                        f"allocate: num_cached={num_cached} is not a cache hit of "
                        f"request {req.req_id!r} (group {g}, block {j})."
                    )
                if block in self._pending_states:
                    return None
                table[j] = block
                hits[g].append(block)
            tables.append(table)
        return tables, hits, from_host

    def _register(
        self,
        req: Request,
        tables: list[list[int]],
        registered: list[int],
        n: int,
    ) -> None:
        """Caches the blocks that are full once `req`'s first `n` tokens are in."""
        for g, table in enumerate(tables):
            bs = self.block_sizes[g]
            full = n // bs
            if full <= registered[g]:
                continue
            hashes = self._block_hashes(req, bs)
            if self.is_mamba[g]:
                # Only a step ending on a block boundary leaves in that block
                # the state after exactly its tokens.
                cols = [full - 1] if n % bs == 0 else []
            else:
                cols = range(registered[g], full)
            for j in cols:
                block = table[j]
                if block and self.allocator.key_of(block) is None:
                    self.allocator.cache(block, key=(g, hashes[j]))
                    self._uncommitted.setdefault(req.req_id, []).append(block)
                    if self.is_mamba[g]:
                        self._pending_states.add(block)
            registered[g] = full


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
