"""Block ids: one free queue for all groups, reference counts, the prefix cache.

Also vLLM's skipped-token rule.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from jaxkv._util import check_positive_int, checks_own_arguments, is_int


class BlockAllocator:
    """Block ids ``1..num_blocks-1`` with reference counts and a prefix cache.

    Block 0 is the null block; the prefix cache maps keys to blocks.

    One free queue for all KV-cache groups: groups overlay the same pages (a
    hybrid pool holds attention and Mamba pages), so an id belongs to one group
    at a time. A block is free when no request holds it; a free block may still
    be *cached* (registered under a prefix-cache key with :meth:`cache`): it can
    be reused by a request whose prefix matches (:meth:`touch`) until
    :meth:`allocate` hands it out again, which evicts it.

    The free queue follows vLLM's ``BlockPool.free_blocks`` (0.32 and 0.33):
    :meth:`allocate` takes from the front; freed blocks that hold no cached
    prefix go to the *front* (reused first, last freed first), freed cached
    blocks to the *back* (evicted last, least recently freed first). A key may
    name several blocks (two requests computed the same prefix at once):
    every copy stays cached, :meth:`lookup` gives the first registered, and
    evicting one copy leaves the others.

    Example:
      >>> import jaxkv
      >>> a = jaxkv.sched.BlockAllocator(4)
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
        # key -> its blocks, first registered first (a dict as an ordered set).
        self._cached: dict[Hashable, dict[int, None]] = {}
        self.num_evictions = 0
        #: Changes with every change of what is cached (a registration, an
        #: eviction, a reset): equal generations, equal prefix cache.
        self.generation = 0
        #: Keep ``(block, key)`` of each block :meth:`allocate` evicts, for
        #: :meth:`take_evicted` (a host tier copies them out first).
        self.record_evictions = False
        self._evicted: list[tuple[int, Hashable]] = []

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._key_of)

    def ref_count(self, block: int) -> int:
        """Requests holding `block`."""
        return self._refs[block]

    def free_queue(self) -> list[int]:
        """The free blocks in the order :meth:`allocate` hands them out."""
        return list(self._free)

    def key_of(self, block: int) -> Hashable | None:
        """The prefix-cache key `block` is registered under, or ``None``."""
        return self._key_of.get(block)

    @checks_own_arguments
    def allocate(self, n: int) -> list[int]:
        """`n` blocks from the front of the free queue, each held once.

        Cached ones handed out are evicted.

        Raises:
          TypeError: If `n` is not an int.
          ValueError: If `n` is negative.
          RuntimeError: If fewer than `n` are free.
        """
        if not is_int(n):
            raise TypeError(f"BlockAllocator.allocate: n must be an int, got {n!r}.")
        if n < 0:
            raise ValueError(f"BlockAllocator.allocate: n must be >= 0, got {n}.")
        if n > len(self._free):
            raise RuntimeError(
                f"Out of KV-cache blocks: need {n}, {len(self._free)} free."
            )
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            if block in self._key_of:
                if self.record_evictions:
                    self._evicted.append((block, self._key_of[block]))
                self._evict(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        self.generation += 1
        key = self._key_of.pop(block)
        copies = self._cached[key]
        del copies[block]
        if not copies:
            del self._cached[key]
        self.num_evictions += 1

    def take_evicted(self) -> list[tuple[int, Hashable]]:
        """The cached blocks :meth:`allocate` evicted since the last call.

        ``(block, key)`` of the cached blocks :meth:`allocate` evicted since
        the last call (with :attr:`record_evictions` set), first evicted first.
        """
        out, self._evicted = self._evicted, []
        return out

    @checks_own_arguments
    def free(self, ids: Sequence[int]) -> None:
        """Drops one hold on each id, in eviction order (first evicted first).

        Ids no request holds any more join the free queue: uncached ones at the
        front (in the given order: ``ids[0]`` is reused first), cached ones at
        the back (in the given order: ``ids[0]`` is evicted first among them).
        Checked before anything changes.

        Raises:
          ValueError: If an id is the null block, out of range or not held (as
            often as it is given).
        """
        for block in ids:
            self._check_held(block)
        drops: dict[int, int] = {}
        for block in ids:
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > self._refs[block]:
                raise ValueError(
                    f"Block id {block} is freed {drops[block]} times but held "
                    f"{self._refs[block]} times."
                )
        front, back = [], []
        for block in ids:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                (back if block in self._key_of else front).append(block)
        for block in reversed(front):
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        for block in back:
            self._free[block] = None

    @checks_own_arguments
    def touch(self, ids: Sequence[int]) -> None:
        """Holds each id once more (a prefix-cache hit); free ones leave the queue."""
        for block in ids:
            _check_id(block)
            if not 0 < block < self.num_blocks:
                raise ValueError(
                    f"Block id {block} is not in 1..{self.num_blocks - 1}."
                )
        for block in ids:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def cache(self, block: int, *, key: Hashable) -> None:
        """Registers a held block under `key`, beside any other copy under it.

        Raises:
          ValueError: If `block` is not held, or already registered under
            another key (a block's tokens never change once it is full).
        """
        self._check_held(block)
        have = self._key_of.get(block)
        if have is not None:
            if have != key:
                raise ValueError(
                    f"Block id {block} is already cached under another key."
                )
            return
        self._cached.setdefault(key, {})[block] = None
        self._key_of[block] = key
        self.generation += 1

    def uncache(self, block: int) -> None:
        """Removes `block` from the prefix cache (no effect if it is not cached)."""
        if block in self._key_of:
            self._evict(block)
            self.num_evictions -= 1

    def lookup(self, key: Hashable) -> int | None:
        """The first registered cached block under `key`, or ``None``."""
        copies = self._cached.get(key)
        return next(iter(copies)) if copies else None

    def in_use(self) -> list[int]:
        """The ids whose bytes matter: held by a request or cached, ascending."""
        return [
            b for b in range(1, self.num_blocks) if self._refs[b] or b in self._key_of
        ]

    def resize(self, num_blocks: int) -> None:
        """Ids ``1..num_blocks-1`` from now on; every kept block keeps its id.

        Grown, the new ids join the *front* of the free queue in ascending
        order (fresh and uncached, used first as freed uncached blocks are),
        so cached free blocks stay where eviction reaches them last. Shrunk,
        the ids past the end must be free: cached ones among them are evicted
        (counted in :attr:`num_evictions`). Checked before anything changes.

        Example (``NORMALIZE_WHITESPACE`` wraps the message):
          >>> import jaxkv
          >>> a = jaxkv.sched.BlockAllocator(4)
          >>> held = a.allocate(2)
          >>> a.resize(6); a.free_queue()
          [4, 5, 3]
          >>> a.resize(2)  # doctest: +NORMALIZE_WHITESPACE
          Traceback (most recent call last):
          ...
          ValueError: BlockAllocator.resize: num_blocks=2 would drop 1 block held
          by requests (ids [2]); at least 3 blocks needed (the largest held id + 1).

        Raises:
          TypeError: If `num_blocks` is not an int.
          ValueError: If it is below 2, or an id it would drop is held.
        """
        num_blocks = check_positive_int(
            "BlockAllocator.resize", "num_blocks", num_blocks
        )
        if num_blocks < 2:
            raise ValueError(
                f"BlockAllocator.resize: num_blocks must be >= 2 (the null block "
                f"and one more), got {num_blocks}."
            )
        held = [b for b in range(num_blocks, self.num_blocks) if self._refs[b]]
        if held:
            raise ValueError(
                f"BlockAllocator.resize: num_blocks={num_blocks} would drop "
                f"{len(held)} block{'s' * (len(held) != 1)} held by requests (ids "
                f"{held[:8]}{' ...' if len(held) > 8 else ''}); at least "
                f"{held[-1] + 1} blocks needed (the largest held id + 1)."
            )
        old = self.num_blocks
        if num_blocks < old:
            for block in range(num_blocks, old):
                if block in self._key_of:
                    if self.record_evictions:
                        self._evicted.append((block, self._key_of[block]))
                    self._evict(block)
                del self._free[block]
            del self._refs[num_blocks:]
        else:
            self._refs.extend([0] * (num_blocks - old))
            for block in range(num_blocks - 1, old - 1, -1):
                self._free[block] = None
                self._free.move_to_end(block, last=False)
        self.num_blocks = num_blocks

    def evict_all(self) -> None:
        """Forgets every cached block (held blocks stay held)."""
        self.generation += 1
        self._cached.clear()
        self._key_of.clear()

    def _check_held(self, block: object) -> None:
        block = _check_id(block)
        if not 0 < block < self.num_blocks or self._refs[block] == 0:
            raise ValueError(
                f"Block id {block} is not held (the null block 0, out of range "
                "or already free)."
            )


def _check_id(block: object) -> int:
    """`block` as an int id; ``1.5`` or ``True`` is not one."""
    if not is_int(block):
        raise TypeError(f"Block id {block!r} is not an int ({type(block).__name__}).")
    return int(block)
