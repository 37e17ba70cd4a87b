"""Pictures of pools, views and steps (matplotlib; ``pip install jaxkv[pictures]``).

Not imported by ``import jaxkv``. Each ``plot_*`` function returns a matplotlib
``Figure``; the data it draws comes from a NumPy function you can check
(:func:`byte_map` for the pool pictures).
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import numpy as np

from jaxkv._specs import MambaSpec
from jaxkv._util import check_positive_int, is_int
from jaxkv.cache import KVCachePlan, KVCacheView, MambaView


def _pyplot() -> Any:
    try:
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "jaxkv.pictures needs matplotlib: pip install 'jaxkv[pictures]'."
        ) from err


def _check_index(fn: str, name: str, value: object, n: int) -> int:
    """`value` as an index in ``[0, n)``, or a clear error (never wrapped)."""
    if not is_int(value):
        raise TypeError(f"{fn}: {name} must be an int, got {value!r}.")
    if not 0 <= int(value) < n:
        raise ValueError(f"{fn}: {name}={value} is not in [0, {n}).")
    return int(value)


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
    """Byte addresses of `view`'s own elements (its blocks, not another layer's
    pages of a packed pool) with dims in `fixed` held at a value.
    """  # noqa: D205
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
    """A pool's bytes as images, one panel per KV-cache group with bytes in it:
    one row per block, colored by owner (gray: padding).

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
    """  # noqa: D205
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
    """A sharded pool on its mesh: one panel per device, the device's bytes
    colored by owner, titled with the device, its data rank and its heads.

    Example:
      >>> import jax, jaxkv
      >>> from jaxkv.pictures import plot_device_map
      >>> mesh = jax.make_mesh((1, 1), ("data", "tensor"))
      >>> sp = jaxkv.shard_plan(jaxkv.tiny_hybrid_config(), mesh=mesh, num_blocks=4)
      >>> plot_device_map(sp).axes[0].get_title()
      'device 0 (data 0, tensor 0): KV heads 0-1'
    """  # noqa: D205
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


def plot_step(
    arrays: Any,
    *,
    group: int = 0,
    block_size: int | None = None,
    staged: Any = None,
) -> Any:
    """One step's batch: query spans, block tables, slot mappings, sampled tokens.

    Args:
      arrays: A :class:`StepArrays` (or anything with its fields).
      group: The KV-cache group whose block table and slots are drawn.
      block_size: The group's block size, to outline the blocks written.
      staged: The staged fast-prefill logits indices (the padded buffer,
        e.g. ``builder.prepare(step).fast_prefill.logits_indices_padded``), drawn
        as a third panel: the real indices, then the padding that repeats the
        last one.

    The top panel has one bar per request over the step's tokens (its query
    span, labelled with the sequence length after the step) and a dot on each
    sampled token; the bottom panel is the group's block table (ids, 0 = null
    block) with the blocks this step writes outlined.

    Example:
      >>> import jaxkv
      >>> from jaxkv.pictures import plot_step
      >>> plan = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=16)
      >>> s = jaxkv.Scheduler(plan)
      >>> _ = s.add_request(jaxkv.Request("a", prompt=[1] * 40, max_new_tokens=1))
      >>> _ = s.add_request(jaxkv.Request("b", prompt=[2] * 5, max_new_tokens=1))
      >>> fig = plot_step(s.schedule(), block_size=32)
      >>> [round(p.get_width()) for p in fig.axes[0].patches]
      [40, 5]
    """
    # Over 80 lines on purpose: one figure drawn top to bottom, panel after
    # panel, each a few matplotlib calls on the same locals; split, each part
    # would take most of them as arguments.
    _check_index("plot_step", "group", group, len(arrays.block_tables))
    if block_size is not None:
        check_positive_int("plot_step", "block_size", block_size)
    plt = _pyplot()
    qsl = np.asarray(arrays.query_start_loc)
    seq = np.asarray(arrays.seq_lens)
    table = np.asarray(arrays.block_tables[group])
    slots = np.asarray(arrays.slot_mappings[group])
    logits = (
        np.zeros(0, int) if arrays.logits_indices is None else arrays.logits_indices
    )
    panels = 2 if staged is None else 3
    fig, axes = plt.subplots(
        panels,
        1,
        figsize=(10, 2.5 + 0.4 * max(1, len(seq)) + (panels - 2)),
        height_ratios=(1, 1, 0.4)[:panels],
    )
    top, bottom = axes[0], axes[1]
    cmap = plt.get_cmap("tab10")
    for r in range(len(seq)):
        top.barh(
            r,
            qsl[r + 1] - qsl[r],
            left=qsl[r],
            color=cmap(r % 10),
            edgecolor="black",
        )
        top.text(qsl[r], r, f" req {r}: seq_len {seq[r]}", va="center", fontsize=7)
    req_of = np.searchsorted(qsl[1:], logits, side="right")
    top.scatter(logits + 0.5, req_of, color="black", marker="o", zorder=3, s=12)
    top.set_xlim(0, max(1, int(qsl[-1])))
    top.invert_yaxis()
    top.set_xlabel("token in the step (dots: sampled)")
    top.set_ylabel("request")
    cols = table.shape[1] if table.size else 1
    used = max(
        1, min(cols, int((table != 0).any(axis=0).nonzero()[0].max(initial=0)) + 2)
    )
    bottom.imshow(
        table[:, :used] if table.size else np.zeros((1, 1)),
        cmap="Greys",
        aspect="auto",
        interpolation="nearest",
        alpha=0.3,
    )
    written = set()
    if block_size:
        for t, s in enumerate(slots):
            if s >= 0:
                r = int(np.searchsorted(qsl[1:], t, side="right"))
                hits = np.flatnonzero(table[r] == s // block_size)
                if hits.size:
                    written.add((r, int(hits[0])))
    for r in range(table.shape[0]):
        for c in range(used):
            bottom.text(c, r, str(table[r, c]), ha="center", va="center", fontsize=7)
            if (r, c) in written:
                bottom.add_patch(
                    plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, lw=1.5)
                )
    bottom.set_xlabel(f"block-table column (group {group}; outlined: written)")
    bottom.set_ylabel("request")
    if staged is not None:
        buf = np.asarray(staged).reshape(1, -1)
        real = len(logits)
        axes[2].imshow(buf, cmap="Blues", aspect="auto", interpolation="nearest")
        for i, v in enumerate(buf[0]):
            axes[2].text(
                i,
                0,
                str(v),
                ha="center",
                va="center",
                fontsize=7,
                color="black" if i < real else "gray",
            )
        axes[2].set_yticks([])
        axes[2].set_xlabel(
            f"staged fast-prefill logits indices ({real} real, then padding)"
        )
    fig.tight_layout()
    return fig


def plot_scaling(results: dict[str, Any], *, title: str = "jaxkv scaling") -> Any:
    """The scaling benchmark's three sweeps (``benchmarks/bench_scaling.py``).

    ``results`` holds ``requests`` and ``context`` sweeps (rows with the swept
    value and ``ms``) and a ``pool`` sweep (``pool_MiB``, ``write_ms``,
    ``attention_ms``), as the benchmark returns them.

    Example:
      >>> from jaxkv.pictures import plot_scaling
      >>> fig = plot_scaling({"requests": [{"requests": 8, "ms": 1.0}],
      ...     "context": [{"context": 128, "ms": 1.0}],
      ...     "pool": [{"pool_MiB": 64, "write_ms": 0.2, "attention_ms": 1.0}]})
      >>> len(fig.axes)
      3
    """
    missing = [k for k in ("requests", "context", "pool") if k not in results]
    if missing:
        raise ValueError(
            f"plot_scaling: results lack the {missing} sweeps (expected 'requests', "
            "'context' and 'pool', as benchmarks/bench_scaling.py returns them)."
        )
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, x, ys in (
        (axes[0], "requests", "requests", ["ms"]),
        (axes[1], "context", "context", ["ms"]),
        (axes[2], "pool", "pool_MiB", ["write_ms", "attention_ms"]),
    ):
        rows = results[key]
        for y in ys:
            ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o", label=y)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel("ms")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig
