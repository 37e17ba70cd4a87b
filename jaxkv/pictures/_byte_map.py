"""Pools drawn byte by byte: which layer, block and head owns each byte.

Pools drawn byte by byte: which layer, K or V, block and head owns each
byte of a pool (:func:`byte_map`), and which device holds it on a mesh.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import numpy as np

from jaxkv._util import check_positive_int, checks_own_arguments
from jaxkv.config import MambaSpec
from jaxkv.pictures._common import _check_index, _check_plan, _pyplot
from jaxkv.plan import KVCachePlan, KVCacheView, MambaView


class ByteMap(NamedTuple):
    """Who owns each byte of one pool.

    Attributes:
      owners: ``(num_blocks, bytes_per_block)`` int16: row ``b`` is the pool's
        bytes ``[b * bytes_per_block, (b + 1) * bytes_per_block)``; each entry
        an index into `labels`, or ``-1`` where no view addresses the byte
        (padding).
      labels: What each index means, e.g. ``"layers.0.self_attn K"``,
        ``"layers.2.mixer state 1"``.
      bytes_per_block: Bytes per row.
    """

    owners: np.ndarray
    labels: list[str]
    bytes_per_block: int


def _addresses(view: KVCacheView, fixed: dict[int, int]) -> np.ndarray:
    """Byte addresses of `view`'s own elements, dims in `fixed` held.

    Byte addresses of `view`'s own elements (its blocks, not another layer's
    pages of a packed pool) with dims in `fixed` held at a value.
    """
    addr = np.full(1, view.offset, np.int64)
    for d, n in enumerate(view.shape):
        step = view.strides[d] * view.itemsize
        idx = np.array([fixed[d]]) if d in fixed else np.arange(n)
        if d == view.block_dim:
            idx = idx[view.owns(idx)]
        addr = (addr[:, None] + idx[None, :].astype(np.int64) * step).ravel()
    return (addr[:, None] + np.arange(view.itemsize)).ravel()


def _parts(name: str, view: Any) -> list[tuple[str, KVCacheView, dict[int, int]]]:
    if isinstance(view, MambaView):
        return [(f"{name} state {i}", s, {}) for i, s in enumerate(view.states)]
    if "kv" in view.axes:
        kv = view.dim("kv")
        return [(f"{name} {h}", view, {kv: i}) for i, h in enumerate("KV")]
    if "head" in view.axes and view.head_size and view.shape[-1] > view.head_size:
        return [(f"{name} K|V", view, {})]  # fused: K and V share the last dim
    return [(name, view, {})]


@checks_own_arguments
def byte_map(plan: KVCachePlan, *, pool: int = 0, group: int | None = None) -> ByteMap:
    """The owner of every byte of `pool`: which layer's K, V or Mamba state.

    With `group`, only that KV-cache group's layers are drawn: a block id is
    handed to one group at a time, so this is what the pool's bytes mean
    while its blocks belong to that group (in a hybrid pool the groups'
    layouts overlay the same pages). Without it, every group is drawn and
    where views overlap the later group's label wins. KV-sharing layers share
    their target's view and are listed once (under the target).

    Example:
      >>> import jaxkv
      >>> from jaxkv.pictures import byte_map
      >>> m = byte_map(jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4))
      >>> m.owners.shape, m.labels[:2]
      ((4, 16384), ['layers.0.self_attn K', 'layers.0.self_attn V'])
    """
    _check_plan("byte_map", "plan", plan)
    _check_index("byte_map", "pool", pool, len(plan.pools))
    if group is not None:
        _check_index(
            "byte_map", "group", group, len(plan.kv_cache_config.kv_cache_groups)
        )
    spec = plan.pools[pool]
    num_blocks = plan.num_blocks
    per_block = spec.size_bytes // num_blocks
    owners = np.full(spec.size_bytes, -1, np.int16)
    labels: list[str] = []
    seen: set[int] = set()
    members = (
        None
        if group is None
        else set(plan.kv_cache_config.kv_cache_groups[group].layer_names)
    )
    for name, view in plan.views.items():
        if members is not None and name not in members:
            continue
        parts = _parts(name, view)
        if id(view) in seen or all(v.pool != pool for _, v, _ in parts):
            continue
        seen.add(id(view))
        for label, v, fixed in parts:
            if v.pool != pool:
                continue
            owners[_addresses(v, fixed)] = len(labels)
            labels.append(label)
    return ByteMap(owners.reshape(num_blocks, per_block), labels, per_block)


def plot_byte_map(plan: KVCachePlan, *, pool: int = 0, max_columns: int = 1024) -> Any:
    """A pool's bytes as images, one panel per KV-cache group.

    Groups with bytes in the pool only: one row per block, colored by owner
    (gray: padding).

    Bytes are binned to at most `max_columns` columns per row (each column
    shows the owner of its first byte; the axis is in bytes); the
    full-resolution maps are :func:`byte_map` with ``group=g``.

    Example:
      >>> import jaxkv
      >>> from jaxkv.pictures import plot_byte_map
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> fig = plot_byte_map(plan)
      >>> [ax.get_title() for ax in fig.axes]  # doctest: +NORMALIZE_WHITESPACE
      ['pool 0 as group 0 sees it', 'pool 0 as group 1 sees it',
       'pool 0 as group 2 sees it']
    """
    _check_index("plot_byte_map", "pool", pool, len(plan.pools))
    check_positive_int("plot_byte_map", "max_columns", max_columns)
    plt = _pyplot()
    colors = importlib.import_module("matplotlib.colors")
    maps = [
        (g, m)
        for g in range(len(plan.kv_cache_config.kv_cache_groups))
        if (m := byte_map(plan, pool=pool, group=g)).labels
    ]
    rows = sum(m.owners.shape[0] for _, m in maps)
    fig, axes = plt.subplots(
        len(maps), 1, figsize=(10, 1.0 + 0.9 * len(maps) + 0.25 * rows), squeeze=False
    )
    tab = plt.get_cmap("tab20").colors
    for ax, (g, m) in zip(axes[:, 0], maps, strict=True):
        step = max(1, -(-m.bytes_per_block // max_columns))
        shown = m.owners[:, ::step]
        palette = ["#dddddd", *[tab[(2 * g + i) % 20] for i in range(len(m.labels))]]
        ax.imshow(
            shown + 1,
            cmap=colors.ListedColormap(palette),
            vmin=0,
            vmax=len(palette) - 1,
            aspect="auto",
            interpolation="nearest",
            extent=(0, m.bytes_per_block, shown.shape[0] - 0.5, -0.5),
        )
        ax.set_title(f"pool {pool} as group {g} sees it")
        ax.set_ylabel("block id")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in palette]
        ax.legend(
            handles,
            ["padding", *m.labels],
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=7,
        )
        ax.set_xlabel("byte in the block's page")
    fig.tight_layout()
    return fig


class DeviceShare(NamedTuple):
    """What one device of a mesh holds of a sharded pool.

    Attributes:
      device: The device's id.
      data: Its data-parallel rank (its own requests and block ids).
      tensor: Its tensor-parallel rank.
      heads: The group's KV heads it holds (global head ids); for a Mamba
        group, the slice of each state's split axis.
      bytes: Bytes of the pool on the device.
    """

    device: int
    data: int
    tensor: int
    heads: range
    bytes: int


def device_map(sharded: Any, *, pool: int = 0, group: int = 0) -> list[DeviceShare]:
    """Which device of a :class:`ShardedPlan`'s mesh holds which part of `pool`.

    Device ``(d, t)`` holds row ``[d, t]`` of the ``(D, T, words)`` pool: the
    rank-local layout (:func:`byte_map` of ``sharded.local``) for the requests
    of data rank ``d`` and the KV heads ``[t * h, (t + 1) * h)`` (``h`` the
    local heads of `group`); with fewer KV heads ``H`` than tensor ranks, head
    ``t * H // T`` (replicated over ``T / H`` ranks). Every device is listed:
    those along a mesh axis that is neither the data nor the tensor axis hold
    copies.

    Raises:
      ValueError: If `pool` or `group` is not one of the plan's.

    Example:
      >>> import jax, jaxkv
      >>> from jaxkv.pictures import device_map
      >>> mesh = jax.make_mesh((1, 1), ("data", "tensor"))
      >>> sp = jaxkv.shard_plan(jaxkv.tiny_hybrid_config(), mesh=mesh, num_blocks=4)
      >>> device_map(sp)[0].heads, device_map(sp)[0].bytes
      (range(0, 2), 65536)
    """
    _check_index("device_map", "pool", pool, len(sharded.local.pools))
    groups = sharded.local.kv_cache_config.kv_cache_groups
    _check_index("device_map", "group", group, len(groups))
    local = groups[group].kv_cache_spec
    tp = sharded.tensor_parallel
    if isinstance(local, MambaSpec):
        axis = next((a for a in local.shard_axes if a is not None), None)
        h = 1 if axis is None else local.shapes[local.shard_axes.index(axis)][axis]
        total = h * tp
    else:
        h = getattr(local, "num_kv_heads", 1)
        total = h * tp
        if sharded.runner_config is not None:
            spec = sharded.runner_config.layer(groups[group].layer_names[0]).spec
            total = getattr(spec, "num_kv_heads", total)

    def heads(t: int) -> range:
        if total >= tp:
            return range(t * h, (t + 1) * h)
        first = t * total // tp  # one head, replicated over tp / total ranks
        return range(first, first + 1)

    names = list(sharded.mesh.axis_names)
    devices = np.asarray(sharded.mesh.devices)
    out = []
    for index in np.ndindex(devices.shape):
        device: Any = devices[index]
        d = index[names.index(sharded.data_axis)] if sharded.data_axis else 0
        t = index[names.index(sharded.tensor_axis)] if sharded.tensor_axis else 0
        out.append(
            DeviceShare(
                device=int(device.id),
                data=d,
                tensor=t,
                heads=heads(t),
                bytes=sharded.local.pools[pool].size_bytes,
            )
        )
    return sorted(out, key=lambda s: (s.data, s.tensor, s.device))


def plot_device_map(
    sharded: Any, *, pool: int = 0, group: int = 0, max_columns: int = 256
) -> Any:
    """A sharded pool on its mesh: one panel per device.

    The device's bytes colored by owner, titled with the device, its data rank and its
    heads.

    Example:
      >>> import jax, jaxkv
      >>> from jaxkv.pictures import plot_device_map
      >>> mesh = jax.make_mesh((1, 1), ("data", "tensor"))
      >>> sp = jaxkv.shard_plan(jaxkv.tiny_hybrid_config(), mesh=mesh, num_blocks=4)
      >>> plot_device_map(sp).axes[0].get_title()
      'device 0 (data 0, tensor 0): KV heads 0-1'
    """
    check_positive_int("plot_device_map", "max_columns", max_columns)
    shares = device_map(sharded, pool=pool, group=group)
    plt = _pyplot()
    colors = importlib.import_module("matplotlib.colors")
    m = byte_map(sharded.local, pool=pool, group=group)
    step = max(1, -(-m.bytes_per_block // max_columns))
    palette = ["#dddddd", *plt.get_cmap("tab20").colors[: max(1, len(m.labels))]]
    rows, cols = sharded.data_parallel, sharded.tensor_parallel
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols + 2, 1.2 + 1.1 * rows), squeeze=False
    )
    for share in shares:
        if share.device != min(  # copies along a spare axis: drawn once
            s.device for s in shares if (s.data, s.tensor) == (share.data, share.tensor)
        ):
            continue
        ax = axes[share.data, share.tensor]
        ax.imshow(
            m.owners[:, ::step] + 1,
            cmap=colors.ListedColormap(palette),
            vmin=0,
            vmax=len(palette) - 1,
            aspect="auto",
            interpolation="nearest",
            extent=(0, m.bytes_per_block, m.owners.shape[0] - 0.5, -0.5),
        )
        what = "KV heads" if m.labels and not m.labels[0].count(" state ") else "split"
        ax.set_title(
            f"device {share.device} (data {share.data}, tensor {share.tensor}): "
            f"{what} {share.heads.start}-{share.heads.stop - 1}",
            fontsize=8,
        )
        ax.tick_params(labelsize=6)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in palette]
    fig.legend(handles, ["padding", *m.labels], loc="upper right", fontsize=7)
    fig.suptitle(f"pool {pool}, group {group}: each device's rows [d, t]")
    fig.tight_layout(rect=(0, 0, 0.8, 0.95))
    return fig
