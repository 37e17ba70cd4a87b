"""Moving a loop's blocks into pools of another size, every block at its id.

:meth:`jaxkv.ServingLoop.resize` allocates the new plan's pools and copies
the blocks whose bytes matter (held by a request or cached) from the old
pools, through each group's views on both sides (kernel blocks, K/V halves,
Mamba states), in chunks of :data:`MOVE_CHUNK` ids so one compiled program
per plan pair moves any number of blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kv import (
    Pools,
    block_views,
    gather_kv_pages,
    read_mamba_state,
    write_kv,
    write_mamba_state,
)
from jaxkv.plan import KVCachePlan, MambaView

MOVE_CHUNK = 256
"""Block ids one compiled move takes (the last chunk padded with ``-1``)."""


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _move(
    src: KVCachePlan, dst: KVCachePlan, src_pools: Pools, dst_pools: Pools, ids
) -> Pools:
    """Blocks `ids` (``-1``: none) of every group from `src_pools` into `dst_pools`."""
    for g, bs in enumerate(src.block_sizes):
        slots = jnp.where(
            ids[:, None] >= 0,
            ids[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)[None, :],
            -1,
        ).reshape(-1)
        pairs = zip(block_views(src, g), block_views(dst, g), strict=True)
        for (s_view, s_group), (d_view, d_group) in pairs:
            if isinstance(s_view, MambaView):
                states = read_mamba_state(src_pools, s_view, ids)
                dst_pools = write_mamba_state(dst_pools, d_view, ids, states)
                continue
            table = s_group.map_to_kernel_block_table(ids[:, None])
            k, v = gather_kv_pages(src_pools, s_view, table)
            k, v = (None if x is None else x.reshape(-1, *x.shape[3:]) for x in (k, v))
            kernel_slots = d_group.map_to_kernel_slot_mapping(slots)
            dst_pools = write_kv(dst_pools, d_view, k, v, kernel_slots)
    return dst_pools


def move_blocks(
    src: KVCachePlan,
    src_pools: Pools,
    dst: KVCachePlan,
    dst_pools: Pools,
    ids: Sequence[int],
) -> Pools:
    """`dst_pools` (donated) with blocks `ids` copied from `src_pools` at their ids.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import jaxkv
      >>> from jaxkv.serve._resize import move_blocks
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> small, big = (jaxkv.make_plan(cfg, num_blocks=n) for n in (8, 16))
      >>> pools = jax.tree.map(lambda a: a + 1, small.allocate())
      >>> moved = move_blocks(small, pools, big, big.allocate(), [3, 5])
      >>> name = cfg.layers[0].name
      >>> k = lambda p, plan, b: jaxkv.gather_kv_pages(p, plan.views[name],
      ...     jnp.array([[b]]))[0]
      >>> bool((k(moved, big, 3) == k(pools, small, 3)).all())
      True
      >>> bool((k(moved, big, 4) == 0).all())  # not moved
      True
    """
    for start in range(0, len(ids), MOVE_CHUNK):
        chunk = np.full(MOVE_CHUNK, -1, np.int32)
        part = list(ids[start : start + MOVE_CHUNK])
        chunk[: len(part)] = part
        dst_pools = _move(src, dst, src_pools, dst_pools, jnp.asarray(chunk))
    return dst_pools
