"""Block ids: one free list for every KV-cache group; vLLM's skipped-token rule."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from jaxkv.specs import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)


class BlockAllocator:
    """Hands out and frees block ids ``1..num_blocks-1`` (0 is the null block).

    One free list for all KV-cache groups: groups overlay the same pages (a hybrid
    pool holds attention and Mamba pages), so an id is given to one group at a
    time.

    Example:
      >>> import jaxkv
      >>> a = jaxkv.BlockAllocator(4)
      >>> ids = a.allocate(2)
      >>> a.num_free, a.free(ids), a.num_free
      (1, None, 3)
    """

    def __init__(self, num_blocks: int) -> None:
        """All ids but the null block start free."""
        self._free = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        """Free ids."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` ids.

        Raises:
          RuntimeError: If fewer than `n` are free.
        """
        if n > len(self._free):
            raise RuntimeError(
                f"Out of KV-cache blocks: need {n}, {len(self._free)} free."
            )
        return [self._free.popleft() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        """Returns ids to the free list."""
        self._free.extend(ids)


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
