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
each step). A copy reads the device block when it runs, so the scheduler
refuses to apply a step while copies recorded by its scheduling are still
pending (the step would have overwritten the blocks to keep). Copies are
dispatched asynchronously, as the step is.

What is copied is each layer's own data through its view, as the step
writes it: per attention layer the K/V of the block's ``block_size`` tokens
(kernel views: the manager block's kernel blocks, strided in a packed
pool), per Mamba layer the
states the block holds, in the cache dtype (no conversion: bf16 and fp8 are
moved as they are stored), bitcast to one byte array per block (one transfer
per block, not one per layer and K/V: measured, the host time in ``flush``
halved).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxkv._util import check_positive_int
from jaxkv.kv import (
    Pools,
    block_views,
    check_pools_alive,
    gather_kv_pages,
    read_mamba_state,
    write_kv,
    write_mamba_state,
)
from jaxkv.plan import KVCachePlan, MambaView, ShardedPlan

#: Blocks copied by one compiled program; longer runs are split, shorter ones
#: padded (ids -1: nothing read back, nothing written).
COPY_BUCKETS = (1, 4, 16)


@dataclasses.dataclass(eq=False)
class _Entry:
    """One block's bytes on the host, per layer.

    One block's bytes on the host: per layer its arrays (``None`` until the
    offload that fills it is flushed).
    """

    group: int
    arrays: Any = None
    dropped: bool = False
    # On a mesh: the blocks' tree, and per leaf the rank's shards on the host.
    treedef: Any = None


@dataclasses.dataclass(frozen=True)
class _Move:
    kind: str  # "offload" (device block -> entry) or "restore" (entry -> block)
    group: int
    block: int
    entry: _Entry


def _read_blocks(
    plan: KVCachePlan, group: int, pools: Pools, ids: jax.Array
) -> tuple[Any, ...]:
    """Per block of `ids`: per layer of `group`, its arrays of the block.

    Per block of `ids` (``(n,)``): per layer of `group`, its arrays of the
    block (K and V ``(block_size, ...)``, or the Mamba states).
    """
    bs = plan.block_sizes[group]
    layers: list[tuple[jax.Array, ...]] = []
    for view, attn_group in block_views(plan, group):
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
    """Writes each block's arrays at `ids` (``-1``: nowhere).

    Writes each block's arrays (as :func:`_read_blocks` gives them) at `ids`
    (``-1``: written nowhere).
    """
    bs = plan.block_sizes[group]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *blocks)
    slots = jnp.where(
        ids[:, None] >= 0,
        ids[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)[None, :],
        -1,
    ).reshape(-1)
    layers = block_views(plan, group)
    for (view, attn_group), arrays in zip(layers, stacked, strict=True):
        if isinstance(view, MambaView):
            pools = write_mamba_state(pools, view, ids, arrays)
            continue
        k, *v = (a.reshape(-1, *a.shape[2:]) for a in arrays)
        kernel_slots = attn_group.map_to_kernel_slot_mapping(slots)
        pools = write_kv(pools, view, k, v[0] if v else None, kernel_slots)
    return pools


def _packed(block: Any) -> jax.Array:
    """One block's arrays (every layer's) as one byte array.

    The host tier moves one array per block, not one per layer and K/V (each array a
    transfer costs host time).
    """
    return jnp.concatenate(
        [
            jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(-1)
            for a in jax.tree.leaves(block)
        ]
    )


def _unpacked(data: jax.Array, like: Any) -> Any:
    """The arrays :func:`_packed` made `data` from (`like`: their shapes)."""
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for s in leaves:
        size = math.prod(s.shape) * s.dtype.itemsize
        chunk = data[offset : offset + size]
        offset += size
        shape = s.shape if s.dtype.itemsize == 1 else (*s.shape, s.dtype.itemsize)
        out.append(jax.lax.bitcast_convert_type(chunk.reshape(shape), s.dtype))
    return jax.tree.unflatten(treedef, out)


def _read_bytes(
    plan: KVCachePlan, group: int, pools: Pools, ids: jax.Array
) -> tuple[jax.Array, ...]:
    """Per block of `ids`, its bytes (:func:`_read_blocks`, :func:`_packed`)."""
    return tuple(_packed(b) for b in _read_blocks(plan, group, pools, ids))


def _write_bytes(
    plan: KVCachePlan,
    group: int,
    pools: Pools,
    ids: jax.Array,
    blocks: tuple[jax.Array, ...],
) -> Pools:
    """Writes blocks as :func:`_read_bytes` gives them at `ids`."""
    like = jax.eval_shape(
        lambda p, i: _read_blocks(plan, group, p, i)[0], pools, ids[:1]
    )
    arrays = tuple(_unpacked(b, like) for b in blocks)
    return _write_blocks(plan, group, pools, ids, arrays)


def _read_ranks(
    sp: ShardedPlan, group: int, pools: Pools, ids: jax.Array
) -> tuple[Any, ...]:
    """:func:`_read_bytes` on every device of the mesh.

    `ids` ``(D, n)``, one row per data rank (``-1``: nothing); leaves ``(D, T, ...)``.
    """

    def per_device(pools: Any, ids: Any) -> Any:
        blocks = _read_bytes(sp.local, group, sp.local_pools(pools), ids[0])
        return jax.tree.map(lambda a: a[None, None], blocks)

    return jax.shard_map(
        per_device,
        mesh=sp.mesh,
        in_specs=(sp.pool_spec, P(sp.data_axis)),
        out_specs=P(sp.data_axis, sp.tensor_axis),
    )(pools, ids)


def _write_ranks(
    sp: ShardedPlan, group: int, pools: Pools, ids: jax.Array, blocks: Any
) -> Pools:
    """:func:`_write_bytes` on every device of the mesh.

    See :func:`_read_ranks`.
    """

    def per_device(pools: Any, ids: Any, blocks: Any) -> Any:
        local = jax.tree.map(lambda a: a[0, 0], blocks)
        out = _write_bytes(sp.local, group, sp.local_pools(pools), ids[0], local)
        return sp.global_pools(out)

    return jax.shard_map(
        per_device,
        mesh=sp.mesh,
        in_specs=(sp.pool_spec, P(sp.data_axis), P(sp.data_axis, sp.tensor_axis)),
        out_specs=sp.pool_spec,
    )(pools, ids, blocks)


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


_read = jax.jit(_read_bytes, static_argnums=(0, 1))
_write = jax.jit(_write_bytes, static_argnums=(0, 1), donate_argnums=2)
_read_mesh = jax.jit(_read_ranks, static_argnums=(0, 1))
_write_mesh = jax.jit(_write_ranks, static_argnums=(0, 1), donate_argnums=2)

# Per plan, its compiled copy programs by (kind, group, bucket): shared by
# every host tier of the plan (a new scheduler compiles nothing again), and
# gone with the plan.
_PROGRAMS: weakref.WeakKeyDictionary[
    KVCachePlan | ShardedPlan, dict[tuple[str, int, int], Any]
] = weakref.WeakKeyDictionary()


class HostKVCache:
    """Prefix-cache blocks kept in host memory after the device evicts them.

    Holds up to `num_blocks` blocks (of any KV-cache group), least recently
    used dropped first. The block manager records offloads when allocation
    evicts a cached block that no other device copy and no host entry holds,
    and restores when a prefix hit reaches a block only the host holds; the
    copies run at :meth:`flush`. An entry stays on the host after a restore
    (evicting that block again copies nothing).

    On a mesh (`sharded`), each data-parallel rank has its own tier (its own
    scheduler's), and the pools are the mesh's global pools: the copies run
    on every device under ``jax.shard_map`` with the other ranks' block ids
    ``-1`` (nothing read, nothing written), and the host keeps only the
    rank's own shards (each tensor rank's heads, on its device's host
    memory). No pool moves between devices.

    Args:
      plan: The plan whose pools are copied (on a mesh: ``sharded.local``).
      num_blocks: Host blocks (each one group's block of every layer).
      memory_kind: Where the copies live: ``"pinned_host"`` (default: the
        device can copy to and from it asynchronously), ``"unpinned_host"``
        or ``"device"`` (a second device tier, for tests).
      sharded: The mesh plan, when the pools are a mesh's.
      rank: The data-parallel rank this tier serves (on a mesh).

    Raises:
      ValueError: If `num_blocks` is not positive, the devices have no memory
        of `memory_kind`, `plan` is not ``sharded.local`` or `rank` is not a
        data rank of the mesh.

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
        sharded: ShardedPlan | None = None,
        rank: int = 0,
    ) -> None:
        """Checks the plan and the memory kind; the host tier starts empty."""
        self.plan = plan
        self.num_blocks = check_positive_int("HostKVCache", "num_blocks", num_blocks)
        self.sharded, self.rank = sharded, rank
        if sharded is not None:
            if plan is not sharded.local:
                raise ValueError(
                    "HostKVCache: on a mesh, plan must be sharded.local (the plan "
                    "each device runs)."
                )
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise TypeError(f"HostKVCache: rank must be an int, got {rank!r}.")
            if not 0 <= rank < sharded.data_parallel:
                raise ValueError(
                    f"HostKVCache: rank={rank} is outside the mesh's "
                    f"{sharded.data_parallel} data-parallel ranks."
                )
            mesh = sharded.mesh
            self._ids_sharding = NamedSharding(mesh, P(sharded.data_axis))
            self._blocks_sharding = NamedSharding(
                mesh, P(sharded.data_axis, sharded.tensor_axis)
            )
            self._zeros: dict[tuple[Any, ...], jax.Array] = {}
        device = jax.devices()[0] if sharded is None else sharded.mesh.devices.flat[0]
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
        self._programs = _PROGRAMS.setdefault(sharded or plan, {})
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

    def claim(self, key: Hashable) -> object:
        """The host's block under `key`, held for a restore recorded later.

        :meth:`record_restore` with ``claimed=`` even if the LRU drops `key` in between:
        the block manager claims what it will restore before the allocation that may
        offload (and so drop) other blocks.

        Raises:
          KeyError: If the host does not hold `key`.
        """
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"HostKVCache.claim: no host block under {key!r}.")
        self._entries.move_to_end(key)
        return entry

    def record_restore(
        self, *, key: Hashable, block: int, claimed: object | None = None
    ) -> None:
        """Records a copy of the host's `key` into device `block`.

        Records a copy of the host's `key` (or of the block :meth:`claim`
        gave, `claimed`) into device `block`.

        Raises:
          KeyError: If the host does not hold `key` and nothing was claimed.
        """
        entry = claimed if isinstance(claimed, _Entry) else self._entries.get(key)
        if entry is None:
            raise KeyError(f"HostKVCache.record_restore: no host block under {key!r}.")
        self._check_block(entry.group, block, "record_restore")
        if key in self._entries:
            self._entries.move_to_end(key)
        self._pending.append(_Move("restore", entry.group, block, entry))

    def discard_pending(self) -> None:
        """Forgets copies not yet run (the pools' contents are gone).

        Entries whose offload never ran leave the host tier.
        """
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
        if self.sharded is None:
            ids = np.full(size, -1, np.int32)
            ids[: len(run)] = [m.block for m in run]
            return size, jax.device_put(ids, self._device)
        ids = np.full((self.sharded.data_parallel, size), -1, np.int32)
        ids[self.rank, : len(run)] = [m.block for m in run]
        return size, jax.device_put(ids, self._ids_sharding)

    def _offload(self, pools: Pools, run: Sequence[_Move]) -> None:
        size, ids = self._ids(run)
        blocks = self._program("read", run[0].group, size, pools)(pools, ids)
        blocks = blocks[: len(run)]
        if self.sharded is not None:
            self._offload_rank(run, blocks)
            return
        host = jax.device_put(blocks, self._host)
        for move, arrays in zip(run, host, strict=True):
            move.entry.arrays = arrays
            self.stats["bytes_to_host"] += _nbytes(arrays)
        self.stats["offloaded_blocks"] += len(run)

    def _offload_rank(self, run: Sequence[_Move], blocks: Sequence[Any]) -> None:
        """Keeps this rank's shards of each block (one per tensor rank)."""
        rank = self.rank
        shards, targets = [], []
        for tree in blocks:
            per_leaf = []
            for leaf in jax.tree.leaves(tree):
                mine = [
                    s.data
                    for s in leaf.addressable_shards
                    if (s.index[0].start or 0) <= rank < (s.index[0].stop or 1 + rank)
                ]
                per_leaf.append(mine)
                targets.append(
                    [
                        SingleDeviceSharding(
                            next(iter(a.devices())), memory_kind=self.memory_kind
                        )
                        for a in mine
                    ]
                )
            shards.append(per_leaf)
        flat = [a for per_leaf in shards for leaf in per_leaf for a in leaf]
        put = iter(jax.device_put(flat, [t for ts in targets for t in ts]))
        for move, tree, per_leaf in zip(run, blocks, shards, strict=True):
            move.entry.treedef = jax.tree.structure(tree)
            move.entry.arrays = [[next(put) for _ in leaf] for leaf in per_leaf]
            self.stats["bytes_to_host"] += _nbytes(move.entry.arrays)
        self.stats["offloaded_blocks"] += len(run)

    def _restore(self, pools: Pools, run: Sequence[_Move]) -> Pools:
        size, ids = self._ids(run)
        if any(m.entry.arrays is None for m in run):  # pragma: no cover
            raise RuntimeError("HostKVCache.flush: a restore before its offload.")
        host = [m.entry.arrays for m in run]
        if self.sharded is None:
            blocks = jax.device_put(host, SingleDeviceSharding(self._device))
        else:
            blocks = self._restore_rank(run)
        blocks += [blocks[0]] * (size - len(run))  # padding: ids -1
        write = self._program("write", run[0].group, size, pools)
        pools = write(pools, ids, tuple(blocks))
        self.stats["restored_blocks"] += len(run)
        self.stats["bytes_to_device"] += _nbytes(host)
        return pools

    def _restore_rank(self, run: Sequence[_Move]) -> list[Any]:
        """Each entry's blocks as global ``(D, T, ...)`` arrays.

        This rank's shards back on their devices, zeros (never written: ids -1) on the
        other ranks' devices.
        """
        sp, sharding = self.sharded, self._blocks_sharding
        assert sp is not None  # noqa: S101 - only called on a mesh
        flat = [a for m in run for leaf in m.entry.arrays for a in leaf]
        on_device = iter(
            jax.device_put(
                flat, [SingleDeviceSharding(next(iter(a.devices()))) for a in flat]
            )
        )
        out = []
        for move in run:
            leaves = []
            for leaf in move.entry.arrays:
                mine = {next(iter(a.devices())): next(on_device) for a in leaf}
                local = leaf[0].shape
                shape = (sp.data_parallel, sp.tensor_parallel, *local[2:])
                arrays = [
                    mine[d] if d in mine else self._zero(local, leaf[0].dtype, d)
                    for d in sharding.addressable_devices
                ]
                leaves.append(
                    jax.make_array_from_single_device_arrays(shape, sharding, arrays)
                )
            out.append(jax.tree.unflatten(move.entry.treedef, leaves))
        return out

    def _zero(self, shape: tuple[int, ...], dtype: Any, device: Any) -> jax.Array:
        key = (shape, np.dtype(dtype), device)
        zero = self._zeros.get(key)
        if zero is None:
            zero = jax.device_put(np.zeros(shape, dtype), SingleDeviceSharding(device))
            self._zeros[key] = zero
        return zero

    def retarget(self, plan: KVCachePlan) -> None:
        """Copies to and from `plan`'s pools from now on (the same model resized).

        Host entries are bytes per block and stay; the compiled copy programs
        (built for the old pools' shapes) are dropped. Nothing may be pending.

        Example (a block offloaded from 8-block pools, restored into 16):
          >>> import jax.numpy as jnp
          >>> import jaxkv
          >>> cfg = jaxkv.tiny_hybrid_config()
          >>> small, big = (jaxkv.make_plan(cfg, num_blocks=n) for n in (8, 16))
          >>> host = jaxkv.sched.HostKVCache(small, num_blocks=4)
          >>> pools, layer = small.allocate(), small.views["layers.0.self_attn"]
          >>> kv = jnp.ones((32, 2, 32))
          >>> pools = jaxkv.write_kv(pools, layer, kv, kv, jnp.arange(32, 64))
          >>> host.record_offload(group=0, block=1, key=(0, b"prefix"))
          >>> _ = host.flush(pools)
          >>> host.retarget(big)
          >>> host.record_restore(key=(0, b"prefix"), block=12)  # past 8: fine
          >>> pools = host.flush(big.allocate())
          >>> k, _ = jaxkv.gather_kv_pages(pools, big.views["layers.0.self_attn"],
          ...     jnp.array([[12]]))
          >>> float(k.sum())
          2048.0
        """
        if self._pending:
            raise RuntimeError(
                "HostKVCache.retarget: copies are pending; flush them on the old "
                "pools first."
            )
        self.plan = plan
        self._programs.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the host tier holds (flushed entries)."""
        return sum(_nbytes(e.arrays) for e in self._entries.values())

    def _program(self, kind: str, group: int, size: int, pools: Any) -> Any:
        """The compiled copy program (compiled once).

        The compiled copy program (kept: compiled once, whatever the
        arrays' committed shardings).
        """
        key = (kind, group, size)
        program = self._programs.get(key)
        if program is None and self.sharded is not None:
            program = self._mesh_program(kind, group, size, pools)
            self._programs[key] = program
        if program is None:
            shapes = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pools
            )
            ids = jax.ShapeDtypeStruct((size,), jnp.int32)
            if kind == "read":
                program = _read.lower(self.plan, group, shapes, ids).compile()
            else:
                blocks = jax.eval_shape(
                    lambda p, i: _read_bytes(self.plan, group, p, i), shapes, ids
                )
                lowered = _write.lower(self.plan, group, shapes, ids, blocks)
                program = lowered.compile()
            self._programs[key] = program
        return program

    def _mesh_program(self, kind: str, group: int, size: int, pools: Any) -> Any:
        sp = self.sharded
        assert sp is not None  # noqa: S101 - only called on a mesh
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sp.pool_sharding),
            pools,
        )
        ids = jax.ShapeDtypeStruct(
            (sp.data_parallel, size), jnp.int32, sharding=self._ids_sharding
        )
        if kind == "read":
            return _read_mesh.lower(sp, group, shapes, ids).compile()
        blocks = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=self._blocks_sharding
            ),
            jax.eval_shape(lambda p, i: _read_ranks(sp, group, p, i), shapes, ids),
        )
        return _write_mesh.lower(sp, group, shapes, ids, blocks).compile()

    def warm_up(self, pools: Any) -> None:
        """Compiles every copy program for pools like `pools`.

        Compiles every copy program (each group, each bucket, both ways) for
        pools like `pools` (arrays or ``jax.ShapeDtypeStruct``), so the first
        eviction in a serving loop compiles nothing.
        """
        for g in range(len(self.plan.block_sizes)):
            for size in COPY_BUCKETS:
                self._program("read", g, size, pools)
                self._program("write", g, size, pools)
