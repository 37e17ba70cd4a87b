"""A transfer drawn: which source bytes land where in the target pool.

A transfer drawn: which bytes of which source blocks land where in the
target pool, token by token, for one layer (:func:`transfer_map`,
:func:`plot_transfer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxkv.pictures._common import _pyplot
from jaxkv.plan import KVCachePlan, KVCacheView


class TransferMap(NamedTuple):
    """Where one layer's tokens lie in the source and the target pool.

    Attributes:
      source: ``(num_blocks, bytes_per_block)`` int32 of the source pool: the
        token whose K or V the byte holds, or ``-1``.
      target: The same for the target pool.
      layer: The layer drawn.
      moved: Tokens moved (held by both sides).
    """

    source: np.ndarray
    target: np.ndarray
    layer: str
    moved: int


def _token_bytes(
    plan: KVCachePlan, layer: str, block_ids: Sequence[int], num_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(token of each byte of the layer's pool or -1, tokens held)``."""
    view = plan.views[layer]
    if not isinstance(view, KVCacheView):
        raise ValueError(f"transfer_map: layer {layer!r} is not an attention layer.")
    g = next(
        i
        for i, grp in enumerate(plan.kv_cache_config.kv_cache_groups)
        if layer in grp.layer_names
    )
    bs, k = plan.block_sizes[g], view.block_size
    ids = np.asarray(block_ids, np.int64)
    if ids.size * bs < num_tokens:
        raise ValueError(
            f"transfer_map: {ids.size} blocks of {bs} tokens hold fewer than "
            f"{num_tokens} tokens."
        )
    tok = np.arange(num_tokens)
    block = ids[tok // bs]
    held = block != 0
    tok = tok[held]
    kb, off = block[held] * (bs // k) + (tok % bs) // k, tok % k
    grids: dict[str, np.ndarray] = {"block": kb, "token": off}
    shape = dict(zip(view.axes, view.shape, strict=True))
    addr = np.full(tok.shape, view.offset, np.int64)
    for d, axis in enumerate(view.axes):
        step = view.strides[d] * view.itemsize
        if axis in grids:
            idx = grids[axis].reshape(-1, *[1] * (addr.ndim - 1))
            addr = addr + idx * step
        else:
            n = shape[axis]
            addr = addr[..., None] + np.arange(n).reshape(*[1] * addr.ndim, n) * step
    addr = addr[..., None] + np.arange(view.itemsize)
    size = plan.pools[view.pool].size_bytes
    owner = np.full(size, -1, np.int32)
    owner[addr.reshape(len(tok), -1)] = tok[:, None]
    return owner.reshape(plan.num_blocks, -1), held


def transfer_map(
    source: KVCachePlan,
    target: KVCachePlan,
    *,
    layer: str,
    source_blocks: Sequence[int],
    target_blocks: Sequence[int],
    num_tokens: int,
) -> TransferMap:
    """Which bytes of `layer`'s pool hold which token, before and after a move.

    :func:`export_request` / :func:`import_request` of a request's first `num_tokens`
    tokens between the two plans' blocks (the layer's group's block ids on each side).
    Tokens one side does not hold (behind a window) are not drawn on either side.

    Example:
      >>> import jaxkv
      >>> from jaxkv.pictures import transfer_map
      >>> src = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> dst = jaxkv.make_plan(jaxkv.tiny_hybrid_config(
      ...     attention_backend="JAX_PAGED_KV_FIRST"), num_blocks=4)
      >>> m = transfer_map(src, dst, layer="layers.0.self_attn",
      ...                  source_blocks=[1], target_blocks=[3], num_tokens=4)
      >>> m.moved, int((m.source >= 0).sum()) == int((m.target >= 0).sum())
      (4, True)
    """
    src, src_held = _token_bytes(source, layer, source_blocks, num_tokens)
    dst, dst_held = _token_bytes(target, layer, target_blocks, num_tokens)
    both = np.flatnonzero(src_held & dst_held)
    keep = np.isin(src, both)
    src = np.where(keep, src, -1)
    dst = np.where(np.isin(dst, both), dst, -1)
    return TransferMap(source=src, target=dst, layer=layer, moved=int(both.size))


def plot_transfer(m: TransferMap, *, max_columns: int = 1024) -> Any:
    """Two panels, source pool above target pool, colored by token.

    Two panels, source pool above target pool, one row per block, each byte
    colored by the token it holds (the same colors on both sides; white: not
    moved), so a token range's color shows where it lands.

    Example:
      >>> import jaxkv
      >>> from jaxkv.pictures import plot_transfer, transfer_map
      >>> src = jaxkv.make_plan(jaxkv.tiny_hybrid_config(), num_blocks=4)
      >>> dst = jaxkv.make_plan(jaxkv.tiny_hybrid_config(
      ...     attention_backend="JAX_PAGED_KV_FIRST"), num_blocks=4)
      >>> fig = plot_transfer(transfer_map(src, dst, layer="layers.0.self_attn",
      ...     source_blocks=[1, 2], target_blocks=[3, 1], num_tokens=40))
      >>> [ax.get_title() for ax in fig.axes[:2]]
      ['source pool: layers.0.self_attn', 'target pool: layers.0.self_attn']
    """
    plt = _pyplot()
    fig, axes = plt.subplots(
        2, 1, figsize=(10, 2.0 + 0.25 * (len(m.source) + len(m.target)))
    )
    top = max(1, int(max(m.source.max(), m.target.max())) + 1)
    for ax, side, title in (
        (axes[0], m.source, "source"),
        (axes[1], m.target, "target"),
    ):
        step = max(1, -(-side.shape[1] // max_columns))
        shown = np.ma.masked_less(side[:, ::step], 0)
        image = ax.imshow(
            shown,
            cmap="viridis",
            vmin=0,
            vmax=top - 1,
            aspect="auto",
            interpolation="nearest",
            extent=(0, side.shape[1], shown.shape[0] - 0.5, -0.5),
        )
        ax.set_title(f"{title} pool: {m.layer}")
        ax.set_ylabel("block id")
        ax.set_xlabel("byte in the block's page")
    fig.colorbar(image, ax=axes, label=f"token ({m.moved} moved)")
    return fig
