"""A request's KV cache on a mesh: heads joined, or split and written.

A request's KV cache on a mesh: read from every tensor-parallel rank of its
data-parallel rank and joined into all heads (:func:`export_rank_request`), or
split into any other tensor-parallel degree's heads and written on each rank
(:func:`import_rank_request`).

Heads are split as :func:`local_kv_heads` says (vLLM's rule): rank ``t`` holds
heads ``[t * H / T, (t + 1) * H / T)``, or, with fewer heads than ranks, head
``t // (T / H)`` replicated; Mamba states along their ``shard_axes``. Each
rank's pool shard is read and written on its own device: nothing gathers a
pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np

from jaxkv.config import MambaSpec
from jaxkv.kv import Pools
from jaxkv.plan import ShardedPlan
from jaxkv.transfer._requests import LayerKV, RequestKV, export_request, import_request


def _check_rank(sharded: ShardedPlan, data: object, fn: str) -> int:
    if isinstance(data, bool) or not isinstance(data, int | np.integer):
        raise TypeError(f"{fn}: data must be an int rank, got {data!r}.")
    if not 0 <= int(data) < sharded.data_parallel:
        raise ValueError(
            f"{fn}: data={data} is outside the mesh's {sharded.data_parallel} "
            "data-parallel ranks."
        )
    return int(data)


def _shard(pool: jax.Array, data: int, tensor: int) -> tuple[int, jax.Array]:
    """``(index among pool.addressable_shards, the rank's local pool)``."""
    for i, shard in enumerate(pool.addressable_shards):
        idx = shard.index
        if idx[0].start in (data, None) and idx[1].start in (tensor, None):
            d = 0 if idx[0].start is None else data - idx[0].start
            t = 0 if idx[1].start is None else tensor - idx[1].start
            return i, shard.data[d, t]
    raise ValueError(
        f"Rank (data={data}, tensor={tensor}) is not addressable from this process."
    )


def _heads_of(tensor: int, num_heads: int, tensor_parallel: int) -> np.ndarray:
    """The global head indices tensor rank `tensor` holds."""
    if num_heads % tensor_parallel == 0:
        per = num_heads // tensor_parallel
        return np.arange(tensor * per, (tensor + 1) * per)
    return np.array([tensor // (tensor_parallel // num_heads)])


def _state_axes(sharded: ShardedPlan, name: str) -> tuple[int | None, ...]:
    cfg = sharded.runner_config
    spec = None if cfg is None else cfg.layer(name).spec
    if not isinstance(spec, MambaSpec):
        return ()
    return tuple(spec.shard_axes) if spec.shard_axes else (None,) * len(spec.shapes)


def export_rank_request(
    sharded: ShardedPlan,
    pools: Pools,
    *,
    data: int,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
) -> RequestKV:
    """Reads a request of data rank `data` from every tensor rank, joined.

    Reads a request of data-parallel rank `data` from every tensor rank and
    joins the heads (and Mamba state slices): the :class:`RequestKV` of the
    global model, which :func:`import_request` or :func:`import_rank_request`
    writes into a plan of any tensor-parallel degree.

    Args:
      sharded: The mesh plan.
      pools: Its global pools (``(D, T, ...)`` each).
      data: The request's data-parallel rank.
      block_ids: Its blocks per KV-cache group (the rank's manager's).
      num_tokens: Tokens computed.

    Raises:
      ValueError: For a rank outside the mesh, or as :func:`export_request`.

    Example:
      >>> import jax, numpy as np
      >>> import jaxkv
      >>> sp = jaxkv.shard_plan(jaxkv.tiny_hybrid_config(),
      ...     mesh=jax.make_mesh((1, 1), ("data", "tensor")), num_blocks=8)
      >>> kv = jaxkv.transfer.export_rank_request(sp, sp.allocate(), data=0,
      ...     block_ids=[[1], [2], [3]], num_tokens=5)
      >>> kv.attention["layers.0.self_attn"].keys.shape  # every KV head
      (5, 2, 32)
    """
    d = _check_rank(sharded, data, "export_rank_request")
    parts = [
        export_request(
            sharded.local,
            tuple(_shard(p, d, t)[1] for p in pools),
            block_ids=block_ids,
            num_tokens=num_tokens,
        )
        for t in range(sharded.tensor_parallel)
    ]
    tp = sharded.tensor_parallel
    attention = {}
    for name, first in parts[0].attention.items():
        heads = _global_heads(sharded, name, first)
        owner = [
            next(t for t in range(tp) if h in _heads_of(t, heads, tp))
            for h in range(heads)
        ]
        local = [_heads_of(t, heads, tp).tolist() for t in range(tp)]

        keys = _join_heads([p.attention[name].keys for p in parts], owner, local)
        values = (
            None
            if first.values is None
            else _join_heads([p.attention[name].values for p in parts], owner, local)
        )
        attention[name] = LayerKV(keys=keys, values=values, present=first.present)
    states = {}
    for name, first in parts[0].states.items():
        axes = _state_axes(sharded, name)
        states[name] = tuple(
            cast(
                jax.Array,
                np.asarray(jax.device_get(first[i]))
                if ax is None
                else np.concatenate(
                    [np.asarray(jax.device_get(p.states[name][i])) for p in parts],
                    axis=ax + 1,
                ),
            )
            for i, ax in enumerate(axes)
        )
    return RequestKV(num_tokens=parts[0].num_tokens, attention=attention, states=states)


def _join_heads(
    parts: Sequence[jax.Array | np.ndarray | None],
    owner: list[int],
    local: list[list[int]],
) -> np.ndarray:
    """All heads, head ``h`` from rank ``owner[h]`` (its ``local[t]`` order)."""
    cols = []
    for h, t in enumerate(owner):
        part = parts[t]
        if part is None:  # pragma: no cover - every rank has the same layers
            raise ValueError("export_rank_request: a rank lacks the layer's values.")
        cols.append(np.asarray(jax.device_get(part))[:, local[t].index(h)])
    return np.stack(cols, axis=1)


def _global_heads(sharded: ShardedPlan, name: str, local: LayerKV) -> int:
    cfg = sharded.runner_config
    spec = None if cfg is None else cfg.layer(name).spec
    heads = getattr(spec, "num_kv_heads", None)
    if heads is None:  # MLA latents are replicated
        return int(local.keys.shape[1]) if local.keys.ndim == 3 else 1
    return int(heads)


def _host(x: jax.Array | np.ndarray) -> Any:
    """A host copy: the ranks' parts live on their own devices."""
    return np.asarray(jax.device_get(x))


def _split(sharded: ShardedPlan, kv: RequestKV, tensor: int) -> RequestKV:
    """Rank `tensor`'s part of a global :class:`RequestKV`."""
    tp = sharded.tensor_parallel
    attention = {}
    for name, layer in kv.attention.items():
        if layer.keys.ndim != 3:  # MLA: replicated
            attention[name] = layer
            continue
        heads = _heads_of(tensor, int(layer.keys.shape[1]), tp)
        attention[name] = LayerKV(
            keys=_host(layer.keys)[:, heads],
            values=None if layer.values is None else _host(layer.values)[:, heads],
            present=layer.present,
        )
    states = {}
    for name, arrays in kv.states.items():
        axes = _state_axes(sharded, name)
        out = []
        for x, ax in zip(arrays, axes, strict=True):
            if ax is None:
                out.append(_host(x))
                continue
            per = x.shape[ax + 1] // tp
            index = np.arange(tensor * per, (tensor + 1) * per)
            out.append(cast(jax.Array, np.take(_host(x), index, axis=ax + 1)))
        states[name] = tuple(out)
    return RequestKV(num_tokens=kv.num_tokens, attention=attention, states=states)


def import_rank_request(
    sharded: ShardedPlan,
    pools: Pools,
    kv: RequestKV,
    *,
    data: int,
    block_ids: Sequence[Sequence[int]],
) -> Pools:
    """Writes a global :class:`RequestKV` into data rank `data` of a mesh.

    Writes a global :class:`RequestKV` (from :func:`export_request` on one
    device, or :func:`export_rank_request` on any mesh) into data-parallel rank
    `data` of `sharded`'s pools: each tensor rank gets its heads and Mamba
    state slices, written on its own device.

    Args:
      sharded: The target mesh plan.
      pools: Its global pools.
      kv: The request's cache, all heads.
      data: The data-parallel rank the request lives on.
      block_ids: Its blocks per KV-cache group (that rank's manager's).

    Returns:
      The global pools, the other ranks' shards untouched (not copied).

    Raises:
      ValueError: If the heads do not split over the tensor axis, or as
        :func:`import_request` (checked on every rank before any is written).

    Example:
      >>> import jax
      >>> import jaxkv
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=8)
      >>> kv = jaxkv.transfer.export_request(plan, plan.allocate(),
      ...                           block_ids=[[1], [2], [3]], num_tokens=5)
      >>> sp = jaxkv.shard_plan(jaxkv.tiny_hybrid_config(),
      ...     mesh=jax.make_mesh((1, 1), ("data", "tensor")), num_blocks=8)
      >>> pools = jaxkv.transfer.import_rank_request(sp, sp.allocate(), kv, data=0,
      ...                                   block_ids=[[4], [5], [6]])
      >>> [p.shape[:2] for p in pools]  # (data, tensor) ranks
      [(1, 1), (1, 1)]
    """
    d = _check_rank(sharded, data, "import_rank_request")
    tp = sharded.tensor_parallel
    for name, layer in kv.attention.items():
        heads = int(layer.keys.shape[1]) if layer.keys.ndim == 3 else tp
        if heads % tp and tp % heads:
            raise ValueError(
                f"import_rank_request: layer {name!r} has {heads} KV heads, which "
                f"do not split over a tensor-parallel axis of {tp}."
            )
    locals_ = []
    for t in range(tp):
        found = [_shard(p, d, t) for p in pools]
        locals_.append((t, found, _split(sharded, kv, t)))
    written = {}
    for t, found, part in locals_:
        written[t] = import_request(
            sharded.local,
            tuple(x for _, x in found),
            part,
            block_ids=block_ids,
        )
    out = []
    for i, pool in enumerate(pools):
        arrays = [s.data for s in pool.addressable_shards]
        for t, found, _ in locals_:
            index, _ = found[i]
            arrays[index] = written[t][i].reshape(arrays[index].shape)
        out.append(
            jax.make_array_from_single_device_arrays(pool.shape, pool.sharding, arrays)
        )
    return tuple(out)
