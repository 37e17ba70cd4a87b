"""Host offload: a second tier of prefix-cache blocks in host memory.

When the block manager hands out a cached block (evicting its prefix from
the device), :class:`HostKVCache` keeps a copy of its bytes in host memory
(``memory_kind="pinned_host"`` by default); a later request whose prefix
hits a block that only the host holds gets a new device block with the
bytes copied back, instead of recomputing those tokens. The manager only
records the copies (:meth:`HostKVCache.record_offload`,
:meth:`HostKVCache.record_restore`); :meth:`HostKVCache.flush` runs them on
the pools, in the order they were recorded, before the next step is
dispatched (:class:`ServingLoop` calls it; your own loop calls it before
each step). Copies are dispatched asynchronously, as the step is.

What is copied is each layer's own data through its view, as the step
writes it: per attention layer the K/V of the block's ``block_size`` tokens
(kernel views: the manager block's kernel blocks, strided in a packed
pool), per Mamba layer the
states the block holds, in the cache dtype (no conversion: bf16 and fp8 are
moved as they are stored).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxkv._util import check_positive_int
from jaxkv.cache import (
    KVCachePlan,
    KVCacheView,
    MambaView,
    Pools,
    check_pools_alive,
    gather_kv_pages,
    read_mamba_state,
    write_kv,
    write_mamba_state,
)
from jaxkv.groups import AttentionGroup

#: Blocks copied by one compiled program; longer runs are split, shorter ones
#: padded (ids -1: nothing read back, nothing written).
COPY_BUCKETS = (1, 4, 16)


@dataclasses.dataclass(eq=False)
class _Entry:
    """One block's bytes on the host: per layer its arrays (``None`` until the
    offload that fills it is flushed).
    """  # noqa: D205

    group: int
    arrays: Any = None
    dropped: bool = False


@dataclasses.dataclass(frozen=True)
class _Move:
    kind: str  # "offload" (device block -> entry) or "restore" (entry -> block)
    group: int
    block: int
    entry: _Entry


def _group_layers(
    plan: KVCachePlan, group: int
) -> list[tuple[str, KVCacheView | MambaView, AttentionGroup]]:
    """The layers of KV-cache group `group` owning their view, in plan order."""
    seen: set[int] = set()
    out = []
    for attn_group in plan.attn_groups[group]:
        for name in attn_group.layer_names:
            view = plan.views[name]
            if id(view) not in seen:
                seen.add(id(view))
                out.append((name, view, attn_group))
    return out


def _read_blocks(
    plan: KVCachePlan, group: int, pools: Pools, ids: jax.Array
) -> tuple[Any, ...]:
    """Per block of `ids` (``(n,)``): per layer of `group`, its arrays of the
    block (K and V ``(block_size, ...)``, or the Mamba states).
    """  # noqa: D205
    bs = plan.block_sizes[group]
    layers: list[tuple[jax.Array, ...]] = []
    for _, view, attn_group in _group_layers(plan, group):
        if isinstance(view, MambaView):
            layers.append(tuple(read_mamba_state(pools, view, ids)))
            continue
        table = attn_group.map_to_kernel_block_table(ids[:, None])
        k, v = gather_kv_pages(pools, view, table)
        layers.append(
            tuple(
                x.reshape(ids.shape[0], bs, *x.shape[3:])
                for x in (k, v)
                if x is not None
            )
        )
    return tuple(
        tuple(tuple(a[i] for a in arrays) for arrays in layers)
        for i in range(ids.shape[0])
    )


def _write_blocks(
    plan: KVCachePlan,
    group: int,
    pools: Pools,
    ids: jax.Array,
    blocks: tuple[Any, ...],
) -> Pools:
    """Writes each block's arrays (as :func:`_read_blocks` gives them) at `ids`
    (``-1``: written nowhere).
    """  # noqa: D205
    bs = plan.block_sizes[group]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *blocks)
    slots = jnp.where(
        ids[:, None] >= 0,
        ids[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)[None, :],
        -1,
    ).reshape(-1)
    layers = _group_layers(plan, group)
    for (_, view, attn_group), arrays in zip(layers, stacked, strict=True):
        if isinstance(view, MambaView):
            pools = write_mamba_state(pools, view, ids, arrays)
            continue
        k, *v = (a.reshape(-1, *a.shape[2:]) for a in arrays)
        kernel_slots = attn_group.map_to_kernel_slot_mapping(slots)
        pools = write_kv(pools, view, k, v[0] if v else None, kernel_slots)
    return pools


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


_read = jax.jit(_read_blocks, static_argnums=(0, 1))
_write = jax.jit(_write_blocks, static_argnums=(0, 1), donate_argnums=2)

# Per plan, its compiled copy programs by (kind, group, bucket): shared by
# every host tier of the plan (a new scheduler compiles nothing again), and
# gone with the plan.
_PROGRAMS: weakref.WeakKeyDictionary[KVCachePlan, dict[tuple[str, int, int], Any]] = (
    weakref.WeakKeyDictionary()
)


class HostKVCache:
    """Prefix-cache blocks kept in host memory after the device evicts them.

    Holds up to `num_blocks` blocks (of any KV-cache group), least recently
    used dropped first. The block manager records offloads when allocation
    evicts a cached block that no other device copy and no host entry holds,
    and restores when a prefix hit reaches a block only the host holds; the
    copies run at :meth:`flush`. An entry stays on the host after a restore
    (evicting that block again copies nothing).

    Args:
      plan: The plan whose pools are copied (one device; not a mesh).
      num_blocks: Host blocks (each one group's block of every layer).
      memory_kind: Where the copies live: ``"pinned_host"`` (default: the
        device can copy to and from it asynchronously), ``"unpinned_host"``
        or ``"device"`` (a second device tier, for tests).

    Raises:
      ValueError: If `num_blocks` is not positive or the device has no memory
        of `memory_kind`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> host = jaxkv.sched.HostKVCache(plan, num_blocks=4)
      >>> pools, layer = plan.allocate(), plan.views["layers.0.self_attn"]
      >>> kv = jnp.ones((32, 2, 32))
      >>> pools = jaxkv.write_kv(pools, layer, kv, kv, jnp.arange(32, 64))
      >>> host.record_offload(group=0, block=1, key=(0, b"prefix"))
      >>> pools = host.flush(pools)   # block 1's K/V are on the host now
      >>> pools = jaxkv.zero_blocks(pools, (layer,), jnp.array([1, 2]))
      >>> host.record_restore(key=(0, b"prefix"), block=2)
      >>> pools = host.flush(pools)
      >>> k, _ = jaxkv.gather_kv_pages(pools, layer, jnp.array([[2]]))
      >>> float(k.sum()), host.stats["restored_blocks"]
      (2048.0, 1)
    """

    def __init__(
        self,
        plan: KVCachePlan,
        *,
        num_blocks: int,
        memory_kind: str = "pinned_host",
    ) -> None:
        """Checks the plan and the memory kind; the host tier starts empty."""
        self.plan = plan
        self.num_blocks = check_positive_int("HostKVCache", "num_blocks", num_blocks)
        device = jax.devices()[0]
        kinds = [m.kind for m in device.addressable_memories()]
        if memory_kind not in kinds:
            raise ValueError(
                f"HostKVCache: memory_kind={memory_kind!r} is not a memory of "
                f"{device.device_kind} devices (they have {kinds})."
            )
        self.memory_kind = memory_kind
        self._device = device
        self._host = SingleDeviceSharding(device, memory_kind=memory_kind)
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._pending: list[_Move] = []
        self._programs = _PROGRAMS.setdefault(plan, {})
        #: Blocks copied each way, their bytes, and entries dropped (LRU).
        self.stats = {
            "offloaded_blocks": 0,
            "restored_blocks": 0,
            "bytes_to_host": 0,
            "bytes_to_device": 0,
            "dropped_blocks": 0,
        }

    # --- the index (host bookkeeping; the block manager calls these) --------

    def __contains__(self, key: Hashable) -> bool:
        """Whether the host holds (or will hold, once flushed) `key`'s block."""
        return key in self._entries

    def __len__(self) -> int:
        """Entries held."""
        return len(self._entries)

    @property
    def num_pending(self) -> int:
        """Copies recorded and not yet run by :meth:`flush`."""
        return len(self._pending)

    def touch(self, key: Hashable) -> None:
        """Marks `key` as used now (dropped last)."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def record_offload(self, *, group: int, block: int, key: Hashable) -> None:
        """Records a copy of device `block` (of `group`) to the host under `key`.

        A no-op (but for recency) when the host holds `key` already. Past
        `num_blocks` entries, the least recently used one is dropped.
        """
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._check_block(group, block, "record_offload")
        entry = _Entry(group)
        self._entries[key] = entry
        self._pending.append(_Move("offload", group, block, entry))
        while len(self._entries) > self.num_blocks:
            _, old = self._entries.popitem(last=False)
            old.dropped = True
            self.stats["dropped_blocks"] += 1

    def record_restore(self, *, key: Hashable, block: int) -> None:
        """Records a copy of the host's `key` into device `block`.

        Raises:
          KeyError: If the host does not hold `key`.
        """
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"HostKVCache.record_restore: no host block under {key!r}.")
        self._check_block(entry.group, block, "record_restore")
        self._entries.move_to_end(key)
        self._pending.append(_Move("restore", entry.group, block, entry))

    def discard_pending(self) -> None:
        """Forgets copies not yet run (the pools' contents are gone): entries
        whose offload never ran leave the host tier.
        """  # noqa: D205
        for move in self._pending:
            if move.kind == "offload":
                for key, entry in list(self._entries.items()):
                    if entry is move.entry:
                        del self._entries[key]
        self._pending.clear()

    def _check_block(self, group: int, block: int, fn: str) -> None:
        if not 0 <= group < len(self.plan.block_sizes):
            raise ValueError(
                f"HostKVCache.{fn}: group={group!r} is not a KV-cache group of the "
                f"plan (it has {len(self.plan.block_sizes)})."
            )
        if not 0 < block < self.plan.num_blocks:
            raise ValueError(
                f"HostKVCache.{fn}: block={block!r} is not a block id of the plan "
                f"(1..{self.plan.num_blocks - 1})."
            )

    # --- the copies ----------------------------------------------------------

    def flush(self, pools: Pools) -> Pools:
        """Runs the recorded copies on `pools`, in order; returns the new pools.

        Offloads read the pools (they stay valid); restores write them, with
        the pools donated. Runs of copies of one kind and group go through one
        compiled program per :data:`COPY_BUCKETS` size. A copy that raised
        stays recorded (with the copies after it): flush again.
        """
        check_pools_alive(pools, "HostKVCache.flush")
        while self._pending:
            first = self._pending[0]
            run = [first]
            for move in self._pending[1 : COPY_BUCKETS[-1]]:
                if move.kind != first.kind or move.group != first.group:
                    break
                run.append(move)
            if first.kind == "offload":
                self._offload(pools, run)
            else:
                pools = self._restore(pools, run)
            del self._pending[: len(run)]
        return pools

    def _ids(self, run: Sequence[_Move]) -> tuple[int, jax.Array]:
        size = next(b for b in COPY_BUCKETS if b >= len(run))
        ids = np.full(size, -1, np.int32)
        ids[: len(run)] = [m.block for m in run]
        return size, jax.device_put(ids, self._device)

    def _offload(self, pools: Pools, run: Sequence[_Move]) -> None:
        _, ids = self._ids(run)
        size = ids.shape[0]
        blocks = self._program("read", run[0].group, size, pools)(pools, ids)
        blocks = blocks[: len(run)]
        host = jax.device_put(blocks, self._host)
        for move, arrays in zip(run, host, strict=True):
            move.entry.arrays = arrays
            self.stats["bytes_to_host"] += _nbytes(arrays)
        self.stats["offloaded_blocks"] += len(run)

    def _restore(self, pools: Pools, run: Sequence[_Move]) -> Pools:
        size, ids = self._ids(run)
        if any(m.entry.arrays is None for m in run):  # pragma: no cover
            raise RuntimeError("HostKVCache.flush: a restore before its offload.")
        host = [m.entry.arrays for m in run]
        blocks = jax.device_put(host, SingleDeviceSharding(self._device))
        blocks += [blocks[0]] * (size - len(run))  # padding: ids -1
        write = self._program("write", run[0].group, size, pools)
        pools = write(pools, ids, tuple(blocks))
        self.stats["restored_blocks"] += len(run)
        self.stats["bytes_to_device"] += _nbytes(host)
        return pools

    @property
    def nbytes(self) -> int:
        """Bytes the host tier holds (flushed entries)."""
        return sum(_nbytes(e.arrays) for e in self._entries.values())

    def _program(self, kind: str, group: int, size: int, pools: Any) -> Any:
        """The compiled copy program (kept: compiled once, whatever the
        arrays' committed shardings).
        """  # noqa: D205
        key = (kind, group, size)
        program = self._programs.get(key)
        if program is None:
            shapes = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pools
            )
            ids = jax.ShapeDtypeStruct((size,), jnp.int32)
            if kind == "read":
                program = _read.lower(self.plan, group, shapes, ids).compile()
            else:
                blocks = jax.eval_shape(
                    lambda p, i: _read_blocks(self.plan, group, p, i), shapes, ids
                )
                lowered = _write.lower(self.plan, group, shapes, ids, blocks)
                program = lowered.compile()
            self._programs[key] = program
        return program

    def warm_up(self, pools: Any) -> None:
        """Compiles every copy program (each group, each bucket, both ways) for
        pools like `pools` (arrays or ``jax.ShapeDtypeStruct``), so the first
        eviction in a serving loop compiles nothing.
        """  # noqa: D205
        for g in range(len(self.plan.block_sizes)):
            for size in COPY_BUCKETS:
                self._program("read", g, size, pools)
                self._program("write", g, size, pools)
