"""Block ids: one free queue for all groups, reference counts, the prefix cache.

Also vLLM's skipped-token rule.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from jaxkv._util import check_positive_int
from jaxkv.specs import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)


class BlockAllocator:
    """Block ids ``1..num_blocks-1`` with reference counts and a prefix cache.

    Block 0 is the null block; the prefix cache maps keys to blocks.

    One free list for all KV-cache groups: groups overlay the same pages (a hybrid
    pool holds attention and Mamba pages), so an id belongs to one group at a
    time. A block is free when no request holds it; a free block may still be
    *cached* (registered under a prefix-cache key with :meth:`cache`): it can
    be reused by a request whose prefix matches (:meth:`touch`) until
    :meth:`allocate` hands it out again, which evicts it. The free queue is
    least-recently-freed first, so cached blocks are evicted in LRU order.

    Example:
      >>> import jaxkv
      >>> a = jaxkv.BlockAllocator(4)
      >>> ids = a.allocate(2)
      >>> a.num_free, a.free(ids), a.num_free
      (1, None, 3)
      >>> (b,) = a.allocate(1)
      >>> a.cache(b, key=(0, b"h")); a.free([b])
      >>> a.lookup((0, b"h")) == b, a.num_free  # freed but still cached
      (True, 3)
      >>> a.touch([b]); a.num_free
      2
    """

    def __init__(self, num_blocks: int) -> None:
        """All ids but the null block start free and uncached."""
        check_positive_int("BlockAllocator", "num_blocks", num_blocks)
        self.num_blocks = int(num_blocks)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}
        self._cached: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        """Requests holding `block`."""
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """`n` blocks, each held once; cached ones handed out are evicted.

        Raises:
          RuntimeError: If fewer than `n` are free.
        """
        if n > len(self._free):
            raise RuntimeError(
                f"Out of KV-cache blocks: need {n}, {len(self._free)} free."
            )
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None and self._cached.get(key) == block:
                del self._cached[key]
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, ids: Sequence[int]) -> None:
        """Drops one hold on each id; ids no request holds join the free queue.

        Raises:
          ValueError: If an id is the null block, out of range or not held.
        """
        for block in ids:
            self._check_held(block)
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def touch(self, ids: Sequence[int]) -> None:
        """Holds each id once more (a prefix-cache hit); free ones leave the queue."""
        for block in ids:
            if not 0 < block < self.num_blocks:
                raise ValueError(
                    f"Block id {block} is not in 1..{self.num_blocks - 1}."
                )
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def cache(self, block: int, *, key: Hashable) -> None:
        """Registers a held block under `key` (first come: an existing entry stays)."""
        self._check_held(block)
        if key not in self._cached and block not in self._key_of:
            self._cached[key] = block
            self._key_of[block] = key

    def lookup(self, key: Hashable) -> int | None:
        """The cached block under `key`, or ``None``."""
        return self._cached.get(key)

    def evict_all(self) -> None:
        """Forgets every cached block (held blocks stay held)."""
        self._cached.clear()
        self._key_of.clear()

    def _check_held(self, block: int) -> None:
        if not 0 < block < self.num_blocks or self._refs[block] == 0:
            raise ValueError(
                f"Block id {block} is not held (the null block 0, out of range "
                "or already free)."
            )


def get_num_skipped_tokens(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """Leading tokens no future query of a request attends to (vLLM's rule).

    Sliding window ``w``: a query at position ``p >= num_computed_tokens`` sees
    keys ``> p - w``, so ``num_computed_tokens - w + 1`` tokens are skipped.
    Chunked local attention of chunk ``c``: keys of earlier chunks are never seen
    again, ``(num_computed_tokens // c) * c``. Other specs skip nothing. Blocks
    whose tokens are all skipped can be freed and replaced by the null block.

    Example:
      >>> import jaxkv
      >>> swa = jaxkv.SlidingWindowSpec(block_size=16, num_kv_heads=1,
      ...     head_size=8, dtype="float32", sliding_window=64)
      >>> jaxkv.get_num_skipped_tokens(swa, 100), jaxkv.get_num_skipped_tokens(swa, 10)
      (37, 0)
    """
    if isinstance(spec, SlidingWindowSpec | SlidingWindowMLASpec):
        return max(0, num_computed_tokens - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk = spec.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk
    return 0
