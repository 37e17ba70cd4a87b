"""A scheduled step drawn, and a scaling benchmark's figures.

A scheduled step drawn: its requests, tokens, block tables and slots, and a
scaling benchmark's figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxkv._util import check_positive_int
from jaxkv.pictures._common import _check_index, _pyplot


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
