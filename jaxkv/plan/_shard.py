"""Pools on a device mesh: tensor-parallel heads, data-parallel requests.

Design (vLLM's, expressed with JAX's own SPMD machinery): every device runs the
*rank-local* plan, the plan of the model with its local head counts (KV heads
and Mamba state heads divided over the tensor axis) and its data-parallel
rank's own blocks. Each pool is one global array of shape ``(D, T, words)``
sharded ``P(data, tensor, None)``: device ``(d, t)`` holds exactly the
rank-local pool ``[d, t]``, a flat array of words like a single-device pool.
Inside ``shard_map`` :meth:`ShardedPlan.local_pools` drops the two unit axes,
and every view, write, read and ``paged_attention`` runs unchanged on the
local pool: nothing crosses devices, nothing copies a pool, and attention and
Mamba layers still share one physical pool per KV-cache tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.config import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RunnerConfig,
)
from jaxkv.plan._allocate import zeros
from jaxkv.plan._grouping import align_hybrid_block_size
from jaxkv.plan._make_plan import make_plan
from jaxkv.plan._plan import KVCachePlan


def local_kv_heads(num_kv_heads: int, tensor_parallel: int) -> int:
    """KV heads one tensor-parallel rank holds (vLLM's rule).

    ``H / T`` when ``T`` divides ``H``; one head, replicated over ``T / H``
    ranks, when ``H`` divides ``T``.

    Raises:
      ValueError: If neither divides the other.

    Example:
      >>> import jaxkv
      >>> jaxkv.plan.local_kv_heads(8, 4), jaxkv.plan.local_kv_heads(2, 8)
      (2, 1)
    """
    if num_kv_heads % tensor_parallel == 0:
        return num_kv_heads // tensor_parallel
    if tensor_parallel % num_kv_heads == 0:
        return 1
    raise ValueError(
        f"{num_kv_heads} KV heads cannot be split over a tensor-parallel axis of "
        f"{tensor_parallel}: one must divide the other."
    )


def _local_mamba(spec: MambaSpec, tensor_parallel: int, owner: str) -> MambaSpec:
    shapes = []
    for i, shape in enumerate(spec.shapes):
        axis = spec.shard_axes[i] if spec.shard_axes else None
        if axis is None:
            shapes.append(shape)
            continue
        if shape[axis] % tensor_parallel:
            raise ValueError(
                f"{owner}: Mamba state {i} of shape {shape} cannot be split over "
                f"{tensor_parallel} tensor-parallel ranks along axis {axis}."
            )
        shapes.append(
            tuple(d // tensor_parallel if a == axis else d for a, d in enumerate(shape))
        )
    # The padded page is re-derived once the local attention page is known.
    return dataclasses.replace(spec, shapes=tuple(shapes), page_size_padded=None)


def local_runner_config(
    runner_config: RunnerConfig, *, tensor_parallel: int
) -> RunnerConfig:
    """The model as one tensor-parallel rank sees it.

    Attention specs keep :func:`local_kv_heads` KV heads and layers ``1/T`` of
    their query heads; MLA latents (one head) are replicated on every rank, as
    vLLM does (a latent is shared by all query heads); Mamba states are split
    along their ``shard_axes`` (replicated where ``None``). A Mamba page padded
    to the attention page in the global model is padded to the local attention
    page, so hybrid pools stay shared.

    Raises:
      ValueError: For heads or states that do not split evenly.

    Example:
      >>> import jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config(num_kv_heads=4, num_heads=8)
      >>> local = jaxkv.plan.local_runner_config(cfg, tensor_parallel=2)
      >>> local.layer("layers.0.self_attn").spec.num_kv_heads
      2
      >>> (local.layer("layers.2.mixer").spec.page_size_bytes
      ...  == local.layer("layers.0.self_attn").spec.page_size_bytes)
      True
    """
    t = tensor_parallel
    if t == 1:
        return runner_config

    def local(spec: KVCacheSpec | None, owner: str) -> KVCacheSpec | None:
        if isinstance(spec, MLAAttentionSpec) or spec is None:
            return spec
        if isinstance(spec, AttentionSpec):
            return dataclasses.replace(
                spec, num_kv_heads=local_kv_heads(spec.num_kv_heads, t)
            )
        if isinstance(spec, MambaSpec):
            return _local_mamba(spec, t, owner)
        return spec

    layers = []
    for layer in runner_config.layers:
        owner = f"LayerConfig({layer.name!r})"
        if layer.num_heads % t:
            raise ValueError(
                f"{owner}: {layer.num_heads} query heads cannot be split over a "
                f"tensor-parallel axis of {t}."
            )
        layers.append(
            dataclasses.replace(
                layer, spec=local(layer.spec, owner), num_heads=layer.num_heads // t
            )
        )
    attention_pages = {
        layer.spec.page_size_bytes
        for layer in layers
        if isinstance(layer.spec, AttentionSpec)
    }
    padded = [
        layer.name
        for layer in runner_config.layers
        if isinstance(layer.spec, MambaSpec) and layer.spec.page_size_padded
    ]
    if padded and len(attention_pages) == 1:
        (page,) = attention_pages
        layers = [
            dataclasses.replace(
                layer,
                spec=dataclasses.replace(layer.spec, page_size_padded=page),
            )
            if layer.name in padded
            and isinstance(layer.spec, MambaSpec)
            and layer.spec.real_page_size_bytes <= page
            else layer
            for layer in layers
        ]
    return dataclasses.replace(runner_config, layers=layers)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ShardedPlan:
    """A rank-local :class:`KVCachePlan` laid out over a mesh.

    Attributes:
      local: The plan every device runs: local heads, its data-parallel rank's
        ``num_blocks`` blocks (block ids are data-parallel-local).
      mesh: The device mesh.
      data_axis: Mesh axis of data parallelism (requests, pages), or ``None``.
      tensor_axis: Mesh axis of tensor parallelism (heads), or ``None``.
      runner_config: The global model the plan was made from (all heads).

    Example:
      >>> import jax, jaxkv
      >>> mesh = jax.make_mesh((1, 1), ("data", "tensor"))
      >>> sp = jaxkv.shard_plan(jaxkv.tiny_hybrid_config(), mesh=mesh, num_blocks=4)
      >>> [p.shape for p in sp.allocate()]
      [(1, 1, 16384), (1, 1, 16384)]
    """

    local: KVCachePlan
    mesh: Mesh
    data_axis: str | None
    tensor_axis: str | None
    runner_config: RunnerConfig | None = None

    @property
    def data_parallel(self) -> int:
        """Size of the data axis (1 without one)."""
        return self.mesh.shape[self.data_axis] if self.data_axis else 1

    @property
    def tensor_parallel(self) -> int:
        """Size of the tensor axis (1 without one)."""
        return self.mesh.shape[self.tensor_axis] if self.tensor_axis else 1

    @property
    def pool_spec(self) -> P:
        """``P(data, tensor, None)``: device ``(d, t)`` holds local pool ``[d, t]``."""
        return P(self.data_axis, self.tensor_axis, None)

    @property
    def pool_sharding(self) -> NamedSharding:
        """The pools' sharding on the mesh."""
        return NamedSharding(self.mesh, self.pool_spec)

    def pool_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes ``(D, T, *local shape)`` of the pools."""
        return [
            (self.data_parallel, self.tensor_parallel, *p.shape)
            for p in self.local.pools
        ]

    def allocate(self) -> tuple[jax.Array, ...]:
        """Zeroed pools, made on their devices (no pool is ever on one device).

        Works in one process and across processes (``jax.distributed``): each
        process materialises only its addressable shards.
        """
        return tuple(
            zeros(shape, np.dtype(p.dtype), self.pool_sharding)
            for shape, p in zip(self.pool_shapes(), self.local.pools, strict=True)
        )

    def check_pools(self, pools: Sequence[jax.Array]) -> None:
        """Host check that `pools` are this plan's.

        One per pool, global shapes ``(D, T, *local shape)`` and dtypes as planned.

        Raises:
          ValueError: Naming the pool and the shapes, e.g. pools allocated for
            another mesh (a 2x4 plan's pools in a 4x2 step).
        """
        if len(pools) != len(self.local.pools):
            raise ValueError(
                f"ShardedPlan: expected {len(self.local.pools)} pools, got "
                f"{len(pools)}."
            )
        for i, (pool, shape, spec) in enumerate(
            zip(pools, self.pool_shapes(), self.local.pools, strict=True)
        ):
            if tuple(pool.shape) != shape or pool.dtype != np.dtype(spec.dtype):
                raise ValueError(
                    f"ShardedPlan: pools[{i}] is {pool.dtype}{list(pool.shape)}; this "
                    f"plan's is {np.dtype(spec.dtype)}{list(shape)} on a "
                    f"{self.data_parallel}x{self.tensor_parallel} (data x tensor) "
                    "mesh: pools allocated for another mesh or plan?"
                )

    def local_pools(self, pools: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Inside ``shard_map``: this device's pools (the local plan's).

        Raises:
          ValueError: If a pool's block is not ``(1, 1, *local shape)`` (pools
            of another mesh or plan; see :meth:`check_pools`).
        """
        for i, (pool, spec) in enumerate(zip(pools, self.local.pools, strict=False)):
            if tuple(pool.shape) != (1, 1, *spec.shape):
                raise ValueError(
                    f"ShardedPlan.local_pools: pools[{i}] has a per-device block "
                    f"{list(pool.shape)}, expected {[1, 1, *spec.shape]}: pools "
                    "allocated for another mesh or plan?"
                )
        return tuple(p.reshape(p.shape[2:]) for p in pools)

    @staticmethod
    def global_pools(pools: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Inside ``shard_map``: local pools back to ``(1, 1, *local shape)`` blocks."""
        return tuple(p.reshape(1, 1, *p.shape) for p in pools)

    def rank_pool(self, pool: jax.Array, *, data: int, tensor: int) -> np.ndarray:
        """Host copy of one rank's local pool (for tests and inspection).

        Raises:
          ValueError: If a rank is outside the mesh, or not addressable from
            this process.
        """
        for name, rank, size in (
            ("data", data, self.data_parallel),
            ("tensor", tensor, self.tensor_parallel),
        ):
            if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
                raise TypeError(f"rank_pool: {name} must be an int, got {rank!r}.")
            if not 0 <= rank < size:
                raise ValueError(
                    f"rank_pool: {name}={rank} is outside the mesh's {size} "
                    f"{name}-parallel ranks."
                )
        for shard in pool.addressable_shards:
            idx = shard.index
            if idx[0].start in (data, None) and idx[1].start in (tensor, None):
                d = 0 if idx[0].start is None else data - idx[0].start
                t = 0 if idx[1].start is None else tensor - idx[1].start
                return np.asarray(shard.data)[d, t]
        raise ValueError(
            f"Rank (data={data}, tensor={tensor}) is not addressable from this process."
        )


def shard_plan(
    runner_config: RunnerConfig,
    *,
    mesh: Mesh,
    data_axis: str | None = "data",
    tensor_axis: str | None = "tensor",
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
    packed: bool = False,
    maps_slot_mapping: bool = False,
    align_hybrid: bool = False,
    storage: str = "auto",
    pool_dtype: str = "auto",
) -> ShardedPlan:
    """Plans a model's KV cache over a mesh (see the module docstring).

    Args:
      runner_config: The global model (all heads).
      mesh: The device mesh.
      data_axis: The data-parallel axis name, or ``None``.
      tensor_axis: The tensor-parallel axis name, or ``None``.
      num_blocks: Blocks per data-parallel rank (per local pool).
      memory_bytes: Or a budget per device, in bytes.
      packed: As in :func:`make_plan`.
      maps_slot_mapping: As in :func:`make_plan`.
      align_hybrid: As in :func:`make_plan`, on the global model first.
      storage: As in :func:`make_plan` (typed pools shard the same way: device
        ``(d, t)`` holds its rank-local typed pool).
      pool_dtype: As in :func:`make_plan`.

    Returns:
      The sharded plan.

    Raises:
      ValueError: For an axis the mesh does not have, or heads that do not
        split over the tensor axis.

    Example:
      >>> import jax, jaxkv
      >>> mesh = jax.make_mesh((1, 1), ("data", "tensor"))
      >>> sp = jaxkv.shard_plan(jaxkv.tiny_hybrid_config(), mesh=mesh, num_blocks=8)
      >>> sp.pool_spec, sp.local.num_blocks
      (P('data', 'tensor', None), 8)
    """
    for name, axis in (("data_axis", data_axis), ("tensor_axis", tensor_axis)):
        if axis is not None and axis not in mesh.shape:
            raise ValueError(
                f"shard_plan: {name}={axis!r} is not an axis of the mesh "
                f"{dict(mesh.shape)}."
            )
    if data_axis is not None and data_axis == tensor_axis:
        raise ValueError(
            f"shard_plan: data_axis and tensor_axis are both {data_axis!r}; use two "
            "mesh axes (or None for one of them)."
        )
    if align_hybrid:
        runner_config = align_hybrid_block_size(runner_config).runner_config
    t = mesh.shape[tensor_axis] if tensor_axis else 1
    local = make_plan(
        local_runner_config(runner_config, tensor_parallel=t),
        num_blocks=num_blocks,
        memory_bytes=memory_bytes,
        packed=packed,
        maps_slot_mapping=maps_slot_mapping,
        storage=storage,
        pool_dtype=pool_dtype,
    )
    return ShardedPlan(
        local=local,
        mesh=mesh,
        data_axis=data_axis,
        tensor_axis=tensor_axis,
        runner_config=runner_config,
    )
