"""The block manager: per-group block tables over one free queue.

The block manager: per-group block tables over one shared free queue, with
prefix caching, window freeing and Mamba state blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from jaxkv._util import cdiv, is_int
from jaxkv.config import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_num_skipped_tokens,
)
from jaxkv.plan import KVCachePlan
from jaxkv.sched._blocks import BlockAllocator
from jaxkv.sched._events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    spec_kind,
)
from jaxkv.sched._host_tier import HostKVCache
from jaxkv.sched._prefix import (
    hash_token_blocks,
    longest_cache_hit,
    prefix_caching_unsupported,
)
from jaxkv.sched._request import Request
from jaxkv.sched._table_rows import StepBlocks, TableRows


class KVCacheManager:
    """Block tables for requests over one :class:`BlockAllocator`.

    Each request holds, per KV-cache group, one block id per ``block_size``
    tokens (0, the null block, where nothing needs to be kept):

    - attention groups hold every block of the sequence; sliding-window and
      chunked-local groups give back the blocks no future query sees
      (:func:`get_num_skipped_tokens`) when every layer reading the group has
      its window;
    - Mamba groups hold the block of the request's last computed token, whose
      page holds the state after it: a step reads the state from column
      ``(num_computed - 1) // block_size`` and writes it to column
      ``(seq_len - 1) // block_size`` (:func:`mamba_state_blocks`); earlier
      columns are given back. A step that ends on a block boundary leaves in
      that block the state after exactly its tokens (vLLM's "align" mode).

    With prefix caching, each block a step fills is registered when it is
    allocated (vLLM's ``allocate_slots``) under the chained hash of its tokens
    (:func:`hash_token_blocks`) and its group, so a request admitted later in
    the same step shares it. A Mamba state is shared only from the next step,
    once written; as in vLLM, it is held by its cache key (a copy being
    computed holds the others), and a prompt's last block-boundary state is
    also held while the step computing the prompt's last tokens runs. A
    new request reuses the longest prefix every group can reuse
    (:func:`longest_cache_hit`, iterated to a length all groups agree on; at
    least one token is always computed). Freed blocks stay cached until
    allocation evicts them (:class:`BlockAllocator`: uncached blocks are
    reused first, cached ones evicted least recently freed first; copies of
    one prefix all stay cached). With `host_blocks`, evicted prefix blocks
    are copied to a :class:`HostKVCache` first, and a hit on a block only the
    host holds takes a new device block with the bytes copied back (run by
    ``manager.host.flush(pools)`` before the step). Models with
    cross-attention or encoder-only caches (not a function of the tokens)
    cannot enable it.

    Args:
      plan: The model's plan (its groups, block sizes and block count).
      enable_prefix_caching: Reuse cached prefixes.
      num_blocks: Blocks to manage (default: the plan's).
      host_blocks: Blocks of the host tier (:attr:`host`; 0: none). Needs
        prefix caching.
      host: A host tier of your own instead (e.g. a mesh rank's
        :class:`HostKVCache`, ``sharded=`` and ``rank=`` set); needs prefix
        caching.
      free_skipped_at: When blocks no later query reads (out of a window,
        Mamba states before the last) are freed: ``"allocate"`` (default), at
        the request's next allocation, vLLM's time; ``"commit"``, right after
        the step. vLLM's time keeps more prefix hits: blocks freed later are
        evicted later (``benchmarks/bench_free_time.py``).
      enable_kv_cache_events: Keep vLLM's KV-cache events (``BlockStored``
        for each block entering the prefix cache, ``BlockRemoved`` for each
        leaving it, ``AllBlocksCleared``) for :meth:`take_events`, which a
        KV-aware router's publisher drains after each step.

    Example:
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
      >>> m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
      >>> a = jaxkv.Request("a", prompt=list(range(70)), max_new_tokens=1)
      >>> m.allocate(a, 70), m.blocks_of(a)
      (True, [[1, 2, 3], [4, 5, 6], [0, 0, 7]])
      >>> a.num_computed = 70; m.commit(a)  # blocks 0, 1 full: cached
      >>> b = jaxkv.Request("b", prompt=list(range(64)) + [9] * 6, max_new_tokens=1)
      >>> m.find_cache_hit(b)  # two full blocks (the Mamba state after 64 not kept)
      0
    """

    def __init__(
        self,
        plan: KVCachePlan,
        *,
        enable_prefix_caching: bool = False,
        num_blocks: int | None = None,
        host_blocks: int = 0,
        host: HostKVCache | None = None,
        enable_kv_cache_events: bool = False,
        free_skipped_at: str = "allocate",
    ) -> None:
        """Reads the groups from `plan`; all blocks start free."""
        if free_skipped_at not in ("allocate", "commit"):
            raise ValueError(
                "KVCacheManager: free_skipped_at must be 'allocate' or 'commit', "
                f"got {free_skipped_at!r}."
            )
        groups = plan.kv_cache_config.kv_cache_groups
        self.plan = plan
        self.block_sizes = [g.kv_cache_spec.block_size for g in groups]
        self.widths = list(plan.block_table_widths)
        self.is_mamba = [isinstance(g.kv_cache_spec, MambaSpec) for g in groups]
        self._spec_kinds = [spec_kind(g.kv_cache_spec) for g in groups]
        # The spec that decides what a group keeps: its own when every layer
        # reading it (KV-sharing layers included) has it; None (keep all) else.
        kinds = plan.group_kinds
        self.specs: list[KVCacheSpec | None] = [
            g.kv_cache_spec if kind in ("window", "mamba") else None
            for g, kind in zip(groups, kinds, strict=True)
        ]
        # Groups that give blocks back before a request ends: windows and
        # Mamba states (full attention keeps every block).
        self._freeing_groups = [
            g for g, kind in enumerate(kinds) if kind in ("window", "mamba")
        ]
        if num_blocks is not None and not 2 <= num_blocks <= plan.num_blocks:
            raise ValueError(
                f"KVCacheManager: num_blocks={num_blocks!r} must be in "
                f"[2, {plan.num_blocks}] (the plan's pools hold {plan.num_blocks})."
            )
        self.allocator = BlockAllocator(
            plan.num_blocks if num_blocks is None else num_blocks
        )
        self.enable_prefix_caching = bool(enable_prefix_caching)
        if self.enable_prefix_caching:
            reason = prefix_caching_unsupported(plan)
            if reason:
                raise ValueError(f"enable_prefix_caching: {reason}")
        if not is_int(host_blocks) or host_blocks < 0:
            raise ValueError(
                f"KVCacheManager: host_blocks must be an int >= 0, got {host_blocks!r}."
            )
        if host is not None and not isinstance(host, HostKVCache):
            raise TypeError(
                "KVCacheManager: host must be a HostKVCache, got "
                f"{type(host).__name__}."
            )
        if host is not None and host_blocks:
            raise ValueError(
                "KVCacheManager: give host_blocks or host, not both (host has its "
                "own num_blocks)."
            )
        if (host_blocks or host is not None) and not self.enable_prefix_caching:
            raise ValueError(
                "KVCacheManager: host_blocks needs enable_prefix_caching=True (the "
                "host tier holds evicted prefix-cache blocks)."
            )
        #: The host tier (``None`` without `host_blocks` or `host`).
        self.host = (
            HostKVCache(plan, num_blocks=int(host_blocks)) if host_blocks else host
        )
        self.free_skipped_at = free_skipped_at
        #: Whether :meth:`take_events` reports prefix-cache changes.
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self._events: list[KVCacheEvent] = []
        self.allocator.record_evictions = (
            self.host is not None or self.enable_kv_cache_events
        )
        self._tables: dict[str, list[list[int]]] = {}
        # The same tables as rows of one array per group, kept in step with
        # the lists, so a batch's block table is one gather (no per-step
        # rebuild from Python lists); rows are recycled, zeroed.
        self._rows = TableRows(self.widths)
        self._hashes: dict[str, dict[int, list[bytes]]] = {}
        self._registered: dict[str, list[int]] = {}
        # Blocks registered at allocation whose step has not been committed
        # yet, per request.
        self._uncommitted: dict[str, list[int]] = {}
        # Mamba states no hit may take before the step ends, by cache key (as
        # vLLM's ``cached_blocks_this_step``), and per request: those it
        # registered (written only at the end of the step) and its prompt
        # boundary's (:meth:`_hold_boundary`).
        self._pending_states: set[tuple[int, bytes]] = set()
        self._pending_of: dict[str, list[tuple[int, bytes]]] = {}
        self._mamba_groups = [g for g, m in enumerate(self.is_mamba) if m]
        # The latest lookup: (request, (cache generation, known tokens), hit).
        self._hit_memo: tuple[Request, tuple[int, int], int] | None = None

    # --- queries ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds."""
        return self.allocator.num_free

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.allocator.num_blocks - 1

    def holds_blocks(self, req: Request) -> bool:
        """Whether `req` holds blocks (allocated and not freed)."""
        return req.req_id in self._tables

    def blocks_of(self, req: Request) -> list[list[int]]:
        """`req`'s block ids per group (a copy; 0 where nothing is kept)."""
        return [list(t) for t in self._tables.get(req.req_id, [])]

    def max_blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """An upper bound on the blocks one request of `num_tokens` holds at once.

        Windowed groups hold at most the window plus one chunk of `chunk`
        tokens; Mamba groups two blocks (the state read and the state written).
        """
        total = 0
        for g in range(len(self.specs)):
            full = cdiv(num_tokens, self.block_sizes[g])
            cap = self._held_cap(g, chunk)
            total += full if cap is None else min(full, cap)
        return total

    def _held_cap(self, g: int, chunk: int) -> int | None:
        """The most blocks group `g` holds for one request (``None``: all).

        The request computes chunks of `chunk` tokens.
        """
        spec = self.specs[g]
        if self.is_mamba[g]:
            return 2
        if isinstance(spec, SlidingWindowSpec | SlidingWindowMLASpec):
            return cdiv(spec.sliding_window - 1 + chunk, spec.block_size) + 1
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return cdiv(spec.attention_chunk_size + chunk, spec.block_size) + 1
        return None

    # --- changes ----------------------------------------------------------------

    def _check_allocate(
        self, req: Request, num_new_tokens: int, num_cached: int, lookahead: int = 0
    ) -> None:
        """Refuses counts that are not non-negative ints, and a late cache hit."""
        for name, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_cached", num_cached),
            ("num_lookahead_tokens", lookahead),
        ):
            if not isinstance(value, int | np.integer):
                raise TypeError(
                    f"allocate: {name} must be an int, got {value!r} for request "
                    f"{req.req_id!r}."
                )
            if isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"allocate: {name} must be a non-negative int, got {value!r} for "
                    f"request {req.req_id!r}."
                )
        if num_cached and (req.num_computed or req.req_id in self._tables):
            raise ValueError(
                f"allocate: request {req.req_id!r} already holds blocks; a cache hit "
                "is only taken at admission."
            )

    def allocate(
        self,
        req: Request,
        num_new_tokens: int,
        *,
        num_cached: int = 0,
        full_sequence_must_fit: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Holds the blocks `req` needs to compute `num_new_tokens` more tokens.

        For a request with nothing computed yet, `num_cached` tokens (from
        :meth:`find_cache_hit`) are taken from the prefix cache first, and
        ``req.num_computed`` set to them. With prefix caching, the blocks this
        step fills are registered here (vLLM's ``allocate_slots``), so a request
        admitted later in the same step shares them: attention reads them after
        this step's writes. A Mamba state is only written at the end of the
        step that computes it, so a hit whose Mamba state block is still being
        computed (registered by another request not yet committed) is refused
        for now, as vLLM defers it to the next step.

        With `full_sequence_must_fit` (vLLM's admission gate, the scheduler's
        ``scheduler_reserve_full_isl``), the blocks are held only if the free
        blocks would hold the request's whole known sequence (``num_tokens``:
        the prompt, and the output of a preempted request), not just this
        chunk; windowed and Mamba groups count the blocks they hold at most.

        `num_lookahead_tokens` more slots are held past them (vLLM's
        ``num_lookahead_tokens``: a draft model writes there); the caller keeps
        them within ``max_model_len``. They count toward the free blocks
        needed, not toward the prefix cache or the full-sequence gate.

        All or nothing: returns ``False`` and changes nothing when too few
        blocks are free or a hit's Mamba state is not computed yet.
        """
        if req.num_computed and not num_cached and req.req_id not in self._tables:
            raise ValueError(
                f"allocate: request {req.req_id!r} has {req.num_computed} computed "
                "tokens but holds no blocks here (freed: finished, aborted or "
                "preempted, or another manager's): its K/V is gone. Start it "
                "again from num_computed=0 (as a preemption does)."
            )
        if self.free_skipped_at == "allocate" and not num_cached:
            held = self._tables.get(req.req_id)
            if held is not None:  # vLLM's remove_skipped_blocks, at allocation
                self._free_skipped(req, held, req.num_computed)
        if (
            num_new_tokens == 1
            and not num_lookahead_tokens
            and not num_cached
            and not full_sequence_must_fit
            and type(num_new_tokens) is int
        ):
            done = self._allocate_decode(req)
            if done is not None:
                return done
        self._check_allocate(req, num_new_tokens, num_cached, num_lookahead_tokens)
        tables = self._tables.get(req.req_id) or [[] for _ in self.block_sizes]
        hits: list[list[int]] = []
        from_host: list[tuple[int, int, bytes]] = []
        if num_cached:
            found = self._hit_tables(req, num_cached)
            if found is None:
                return False
            tables, hits, from_host = found
        start = num_cached or req.num_computed
        end = start + num_new_tokens
        slots = end + num_lookahead_tokens
        if self._fewest_new(tables, start, slots) > self.num_free_blocks:
            return False  # before listing columns: 10**9 tokens cost nothing
        new = [
            self._new_columns(g, tables[g], start, slots) for g in range(len(tables))
        ]
        need = sum(map(len, new)) + len(from_host)
        touched_free = (
            sum(
                self.allocator.ref_count(b) == 0 for blocks in hits for b in set(blocks)
            )
            if hits
            else 0
        )
        if need + touched_free > self.allocator.num_free:
            return False
        if full_sequence_must_fit and req.num_tokens > end:
            whole = len(from_host)
            for g in range(len(tables)):
                cols = len(self._new_columns(g, tables[g], start, req.num_tokens))
                cap = self._held_cap(g, num_new_tokens)
                whole += cols if cap is None else min(cols, cap)
            if whole + touched_free > self.allocator.num_free:
                return False
        for blocks in hits:
            self.allocator.touch(blocks)
        # Held before the allocation: its evictions offload blocks to the host,
        # and a small host tier may drop the very blocks this hit restores.
        claimed = (
            [self.host.claim((g, h)) for g, _, h in from_host]
            if self.host is not None
            else [None] * len(from_host)
        )
        if need:
            ids = iter(self.allocator.allocate(need))
            for g, cols in enumerate(new):
                for j in cols:
                    tables[g] += [0] * (j + 1 - len(tables[g]))
                    tables[g][j] = next(ids)
            self._take_evicted()
            for (g, j, block_hash), entry in zip(from_host, claimed, strict=True):
                tables[g][j] = block = next(ids)
                self.allocator.cache(block, key=(g, block_hash))
                if self.enable_kv_cache_events:
                    self._stored(req, g, j, j + 1, [block_hash])
                if self.host is not None:
                    self.host.record_restore(
                        key=(g, block_hash), block=block, claimed=entry
                    )
        self._tables[req.req_id] = tables
        for g, cols in enumerate(new):
            self._rows.set(req.req_id, g, cols, tables[g])
        for g, blocks in enumerate(hits):
            if blocks or any(h[0] == g for h in from_host):
                self._rows.set(req.req_id, g, range(len(tables[g])), tables[g])
        registered = self._registered.setdefault(req.req_id, [0] * len(tables))
        if num_cached:
            registered[:] = [num_cached // bs for bs in self.block_sizes]
            req.num_computed = num_cached
            req.num_cached_tokens += num_cached
        if self.enable_prefix_caching:
            n = min(end, req.num_known_tokens)
            self._register(req, tables, registered, n)
            if self._mamba_groups:
                self._hold_boundary(req, tables, n)
        return True

    def _hold_boundary(self, req: Request, tables: list[list[int]], n: int) -> None:
        """Holds back hits on `req`'s prompt-boundary Mamba state this step.

        vLLM's rule (``MambaManager._cache_partial_tail_block``): while a
        step's cacheable tokens end on the last block boundary before the
        prompt's end (the state a resent prompt resumes from), that state is
        treated as written this step, so another request's hit on it waits
        for the next step.
        """
        for g in self._mamba_groups:
            bs = self.block_sizes[g]
            boundary = (len(req.prompt) - 1) // bs * bs
            if not boundary or n // bs * bs != boundary:
                continue
            j = boundary // bs - 1
            table = tables[g]
            if j < len(table) and table[j]:
                self._hold(req, (g, self._block_hashes(req, bs)[j]))

    def _hold(self, req: Request, key: tuple[int, bytes]) -> None:
        """Keeps hits off the Mamba state under `key` until `req`'s step ends.

        Keeps hits off the Mamba state cached under `key` until `req`'s
        step is committed (or `req` freed).
        """
        if key not in self._pending_states:
            self._pending_states.add(key)
            self._pending_of.setdefault(req.req_id, []).append(key)

    def _take_evicted(self) -> None:
        """Reports the cached blocks an allocation just evicted.

        An event each; and a host copy recorded of each whose prefix no other
        device block and no host entry holds.
        """
        if not self.allocator.record_evictions:
            return
        for block, key in self.allocator.take_evicted():
            group, block_hash = cast(tuple[int, bytes], key)
            if self.enable_kv_cache_events:
                self._events.append(
                    BlockRemoved(block_hashes=(block_hash,), group_idx=group)
                )
            if self.host is not None and self.allocator.lookup(key) is None:
                self.host.record_offload(group=group, block=block, key=key)

    def _stored(
        self, req: Request, g: int, start: int, end: int, stored: list[bytes]
    ) -> None:
        """Reports `req`'s blocks ``[start, end)`` of group `g`, `stored` cached.

        vLLM's ``cache_full_blocks`` event: the range's tokens, the parent
        of its first block, the hashes of the blocks it cached.
        """
        bs = self.block_sizes[g]
        parent = self._block_hashes(req, bs)[start - 1] if start else None
        kind, window = self._spec_kinds[g]
        self._events.append(
            BlockStored(
                block_hashes=tuple(stored),
                parent_block_hash=parent,
                token_ids=tuple(req.token_range(start * bs, end * bs)),
                block_size=bs,
                group_idx=g,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
        )

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix-cache events since the last call, oldest first.

        vLLM's ``take_events``; empty unless ``enable_kv_cache_events``.

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.llama_like_config(num_layers=1),
          ...     num_blocks=8)
          >>> m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True,
          ...     enable_kv_cache_events=True)
          >>> r = jaxkv.Request("a", prompt=list(range(20)), max_new_tokens=1)
          >>> m.allocate(r, 20)
          True
          >>> [(type(e).__name__, e.token_ids[:3]) for e in m.take_events()]
          [('BlockStored', (0, 1, 2))]
        """
        out, self._events = self._events, []
        return out

    def requeue_events(self, events: Sequence[KVCacheEvent]) -> None:
        """Puts `events` back before those pending (a publisher that failed)."""
        if self.enable_kv_cache_events:
            self._events[:0] = list(events)

    def _allocate_decode(self, req: Request) -> bool | None:
        """One more token where every group has its block already.

        Most decode steps; ``None`` when a block is needed (the general path
        decides).
        """
        tables = self._tables.get(req.req_id)
        if tables is None:
            return None
        pos = req.num_computed
        for table, bs in zip(tables, self.block_sizes, strict=True):
            j = pos // bs
            if j >= len(table) or not table[j]:
                return None
        if self.enable_prefix_caching:
            # Blocks whose tokens are all known: with async scheduling the
            # decode token itself may still be on the device (registered by
            # the next step, when it is known).
            n = min(pos + 1, req.num_known_tokens)
            if any(n % bs == 0 for bs in self.block_sizes):
                self._register(req, tables, self._registered[req.req_id], n)
        return True

    def _fewest_new(self, tables: list[list[int]], start: int, end: int) -> int:
        """A lower bound of the new blocks ``[start, end)`` needs, without listing.

        Columns past a full-attention group's table all need a block.
        """
        if end - start <= 1:
            return 0
        return sum(
            max(0, cdiv(end, self.block_sizes[g]) - max(start // bs, len(table)))
            for g, table in enumerate(tables)
            if not self.is_mamba[g] and (bs := self.block_sizes[g])
        )

    def _new_columns(self, g: int, table: list[int], start: int, end: int) -> list[int]:
        """Columns of group `g` that need a new block to compute ``[start, end)``."""
        if end <= start:
            return []
        bs = self.block_sizes[g]
        if self.is_mamba[g] or end - start == 1:  # a Mamba state, or a decode
            dst = (end - 1) // bs
            return [] if dst < len(table) and table[dst] else [dst]
        return [
            j
            for j in range(start // bs, cdiv(end, bs))
            if j >= len(table) or not table[j]
        ]

    def register_computed(self, req: Request, *, num_tokens: int | None = None) -> None:
        """Caches every block `req`'s computed tokens fill.

        With prefix caching, caches every block `req`'s computed tokens
        fill (after a step of several tokens per request, e.g.
        :meth:`Scheduler.schedule_decode`, whose blocks the per-token decode
        path would only register at the next boundary); a no-op otherwise.
        `num_tokens` caps the tokens counted (default: ``req.num_computed``;
        never more than the tokens whose values are known).
        """
        if not self.enable_prefix_caching:
            return
        tables = self._tables_of(req, "register_computed")
        n = min(req.num_computed, req.num_known_tokens)
        if num_tokens is not None:
            n = min(n, num_tokens)
        registered = self._registered.setdefault(req.req_id, [0] * len(tables))
        self._register(req, tables, registered, n)

    def commit(self, req: Request) -> None:
        """After a step: frees what `req` no longer needs.

        Blocks no window of a future query reaches, Mamba states before its last and
        marks the Mamba states it computed as ready for hits; ``req.num_computed`` must
        already count the step's tokens.

        With ``free_skipped_at="commit"`` it also frees what no later query
        reads, as soon as the step ran; by default that waits for the
        request's next allocation, as vLLM's ``allocate_slots``.
        """
        tables = self._tables_of(req, "commit")
        n = req.num_computed
        for g, table in enumerate(tables):
            if not self.is_mamba[g] and len(table) * self.block_sizes[g] < n:
                raise ValueError(
                    f"commit: request {req.req_id!r} counts {n} computed tokens, "
                    f"but group {g} holds blocks for {len(table) * self.block_sizes[g]}"
                    ": allocate the step's tokens before computing them (their K/V "
                    "had nowhere to go)."
                )
        self._uncommitted.pop(req.req_id, None)
        if self._pending_of:
            self._pending_states.difference_update(self._pending_of.pop(req.req_id, ()))
        if self.free_skipped_at == "commit":
            self._free_skipped(req, tables, n)

    def _free_skipped(self, req: Request, tables: list[list[int]], n: int) -> None:
        """Frees the blocks of `req` no query after its first `n` tokens reads."""
        for g in self._freeing_groups:
            table = tables[g]
            bs = self.block_sizes[g]
            spec = self.specs[g]
            if self.is_mamba[g]:
                keep = max(0, (n - 1) // bs)
            elif spec is None:
                keep = 0
            else:
                keep = min(get_num_skipped_tokens(spec, n) // bs, len(table))
            gone = [b for b in table[:keep] if b]
            if gone:
                self.allocator.free(gone[::-1])
                table[:keep] = [0] * keep
                self._rows.zero(req.req_id, g, keep)

    def free_beyond(self, req: Request, num_tokens: int) -> None:
        """Gives back `req`'s attention blocks past its first `num_tokens` tokens.

        The slots of rejected draft tokens; Mamba states are kept.
        """
        tables = self._tables_of(req, "free_beyond")
        for g, table in enumerate(tables):
            if self.is_mamba[g]:
                continue
            keep = cdiv(num_tokens, self.block_sizes[g])
            gone = [b for b in table[keep:] if b]
            if gone:
                self.allocator.free(gone[::-1])
                self._rows.zero_from(req.req_id, g, keep)
            del table[keep:]

    def free(self, req: Request) -> None:
        """Gives back every block `req` holds.

        Finished, rejected or preempted. Cached ones stay reusable until evicted, the
        last blocks first.
        """
        tables = self._tables.pop(req.req_id, None)
        # Blocks registered for a step that was never committed may never have
        # been computed: they leave the cache (losing an entry is safe).
        self._pending_states.difference_update(self._pending_of.pop(req.req_id, ()))
        for block in self._uncommitted.pop(req.req_id, ()):
            key = self.allocator.key_of(block)
            if key is not None and self.enable_kv_cache_events:
                group, block_hash = cast(tuple[int, bytes], key)
                self._events.append(
                    BlockRemoved(block_hashes=(block_hash,), group_idx=group)
                )
            self.allocator.uncache(block)
        self._registered.pop(req.req_id, None)
        self._hashes.pop(req.req_id, None)
        for table in tables or []:
            self.allocator.free([b for b in table[::-1] if b])
        self._rows.release(req.req_id)

    def resize(self, plan: KVCachePlan) -> None:
        """Manages `plan`'s blocks from now on: the same model, another size.

        Every block keeps its id (requests' tables, the prefix cache and the
        host tier stay valid); grown, the new blocks are free, used first;
        shrunk, the blocks past the end must be free, and cached ones among
        them leave the prefix cache (``BlockRemoved`` events; not offloaded
        to the host tier). The pools are the caller's to copy (see
        :meth:`jaxkv.ServingLoop.resize`). Checked before anything changes.

        Raises:
          ValueError: If `plan` is another model's or has other block sizes,
            or a block it would drop is held.
        """
        if (
            not isinstance(plan, KVCachePlan)
            or plan.runner_config != self.plan.runner_config
            or plan.block_sizes != self.plan.block_sizes
            or plan.block_table_widths != self.plan.block_table_widths
        ):
            raise ValueError(
                "KVCacheManager.resize: plan must be the same model's plan with "
                "another num_blocks (same runner config, block sizes and table "
                f"widths), got {type(plan).__name__}."
            )
        self.allocator.resize(plan.num_blocks)
        self.plan = plan
        self._hit_memo = None
        if self.enable_kv_cache_events:
            for _, key in self.allocator.take_evicted():
                group, block_hash = cast(tuple[int, bytes], key)
                self._events.append(
                    BlockRemoved(block_hashes=(block_hash,), group_idx=group)
                )
        else:
            self.allocator.take_evicted()
        if self.host is not None:
            self.host.retarget(plan)

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (vLLM's ``reset_prefix_cache``).

        For when the pools' contents are gone. Only possible with no block held; returns
        whether it was reset.

        Example:
          >>> import jaxkv
          >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
          >>> m = jaxkv.KVCacheManager(plan, enable_prefix_caching=True)
          >>> m.reset_prefix_cache(), m.allocator.num_cached
          (True, 0)
        """
        if self._tables or self.allocator.num_free != self.num_usable_blocks:
            return False
        self.allocator = BlockAllocator(self.allocator.num_blocks)
        self._hit_memo = None
        self.allocator.record_evictions = (
            self.host is not None or self.enable_kv_cache_events
        )
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        if self.host is not None:
            self.host.discard_pending()  # what they would copy is gone
        self._hashes.clear()
        self._registered.clear()
        self._uncommitted.clear()
        self._pending_of.clear()
        self._pending_states.clear()
        return True

    def _tables_of(self, req: Request, caller: str) -> list[list[int]]:
        tables = self._tables.get(getattr(req, "req_id", ""))
        if tables is None:
            raise ValueError(
                f"{caller}: request {getattr(req, 'req_id', req)!r} holds no blocks "
                "(never allocated, or freed: finished, aborted or preempted)."
            )
        return tables

    def step_blocks(self, batch: Sequence[tuple[Request, int]]) -> StepBlocks:
        """Block tables and slot mappings of a scheduled batch.

        Each entry is ``(request, tokens this step)``, the request's tokens from
        ``num_computed`` on (its blocks allocated with :meth:`allocate`).
        """
        return self._rows.batch_blocks(
            batch,
            [self._tables_of(req, "step_blocks") for req, _ in batch],
            block_sizes=self.block_sizes,
            is_mamba=self.is_mamba,
            max_model_len=self.plan.runner_config.max_model_len,
        )

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
        known = req.num_known_tokens
        memo = self._hit_memo
        if (
            memo is not None
            and memo[0] is req
            and memo[1] == (self.allocator.generation, known)
            and self.host is None
        ):
            return memo[2]  # the head of the queue, blocked, nothing changed
        hit = known - 1
        # Full attention's hit is a prefix rule: under a lower bound it is
        # the old hit, capped; no block is looked up twice.
        full: dict[int, int] = {}
        while True:
            agreed = hit
            for g, spec in enumerate(self.specs):
                bs = self.block_sizes[g]
                hashes = self._block_hashes(req, bs)
                bound = min(agreed // bs, len(hashes))
                if g in full:
                    k = min(full[g], bound)
                else:
                    k = longest_cache_hit(
                        spec,
                        num_blocks=bound,
                        is_cached=lambda j, g=g, h=hashes: self._is_cached((g, h[j])),
                    )
                    if spec is None:
                        full[g] = k
                agreed = k * bs
            if agreed == hit:
                self._hit_memo = (req, (self.allocator.generation, known), hit)
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
        """Per group, the tables and blocks of a cache hit of `num_cached` tokens.

        ``(tables, hit blocks, host hits)`` per group of a cache hit of
        `num_cached` tokens, or ``None`` while a hit block's Mamba state is
        still pending. Host hits are ``(group, column, hash)`` of blocks only
        the host tier holds (their column is 0 until a block is allocated).
        """
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
                if self.is_mamba[g] and (g, hashes[j]) in self._pending_states:
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
            stored = []
            for j in cols:
                block = table[j]
                if block and self.allocator.key_of(block) is None:
                    self.allocator.cache(block, key=(g, hashes[j]))
                    stored.append(hashes[j])
                    self._uncommitted.setdefault(req.req_id, []).append(block)
                    if self.is_mamba[g]:
                        self._hold(req, (g, hashes[j]))
            if self.enable_kv_cache_events:  # one event per group, as vLLM's
                self._stored(req, g, registered[g], full, stored)
            registered[g] = full
