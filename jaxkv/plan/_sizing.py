"""The KV cache sized from memory: the largest pool the compiled step leaves room for.

vLLM profiles a forward pass and gives the KV cache what is left of
``gpu_memory_utilization`` of the device. XLA tells the same without running
anything: a program compiled from abstract arguments reports its argument,
output, aliased and temporary bytes per device (``memory_analysis()``).
:func:`size_kv_cache` compiles your step at two small pool sizes, fits the
step's bytes as ``fixed + per_block x num_blocks`` (the pools, and anything
your step holds per block), and returns the largest block count within the
budget, checked by compiling the step at that size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxkv._util import check_positive_int, checks_own_arguments, is_int
from jaxkv.config import RunnerConfig
from jaxkv.plan._make_plan import make_plan
from jaxkv.plan._plan import KVCachePlan
from jaxkv.plan._shard import shard_plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSizing:
    """What :func:`size_kv_cache` counted, per device (printable).

    Attributes:
      num_blocks: The blocks chosen: the largest count whose compiled step
        fits the budget.
      budget_bytes: The budget per device.
      budget_source: Where the budget came from (``memory_bytes=`` or a
        fraction of the device's ``bytes_limit``).
      fixed_bytes: The step's bytes that do not grow with the pools
        (weights, step inputs, activations, temporaries, code).
      bytes_per_block: What one more block costs the step, per device: its
        pages in every pool, and anything the step holds per block.
      pool_bytes_per_block: The pools' own bytes per block, all pools,
        unsharded (on a mesh each device holds its share; `bytes_per_block`
        is measured per device).
      step_bytes: The compiled step's bytes at `num_blocks` (at most the
        budget).
      probes: ``(num_blocks, bytes)`` of each compile.
    """

    num_blocks: int
    budget_bytes: int
    budget_source: str
    fixed_bytes: int
    bytes_per_block: int
    pool_bytes_per_block: int
    step_bytes: int
    probes: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        """The record, one figure per line."""
        mib = 2**20
        return "\n".join(
            [
                f"KV cache sized: {self.num_blocks} blocks",
                f"  budget per device   {self.budget_bytes / mib:12.1f} MiB "
                f"({self.budget_source})",
                f"  step, fixed         {self.fixed_bytes / mib:12.1f} MiB "
                "(weights, inputs, activations, temporaries, code)",
                f"  per block           {self.bytes_per_block:12d} B "
                f"(pools {self.pool_bytes_per_block} B)",
                f"  step at {self.num_blocks} blocks {self.step_bytes / mib:10.1f} MiB",
                f"  compiles            {len(self.probes):12d}",
            ]
        )


def step_bytes(compiled: Any) -> int:
    """Peak bytes per device a compiled program reports needing.

    Its arguments, plus its outputs not aliased to a donated argument, plus
    its temporaries and generated code (``memory_analysis()``).

    Raises:
      ValueError: If the backend reports no memory analysis.
    """
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(
            "size_kv_cache: this backend reports no memory analysis for a "
            "compiled program; give num_blocks by hand."
        )
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
        + stats.generated_code_size_in_bytes
    )


def _device_budget(
    memory_bytes: object, memory_fraction: object, device: Any = None
) -> tuple[int, str]:
    """``(bytes, where they came from)``: `memory_bytes`, or a fraction of the device's.

    Raises:
      ValueError: If neither is usable (a backend that reports no memory
        limit, as XLA:CPU, needs `memory_bytes`), naming both.
    """
    if memory_bytes is not None:
        return check_positive_int("size_kv_cache", "memory_bytes", memory_bytes), (
            "memory_bytes"
        )
    if (
        isinstance(memory_fraction, bool)
        or not isinstance(memory_fraction, int | float)
        or not 0 < memory_fraction <= 1
    ):
        raise ValueError(
            "size_kv_cache: memory_fraction must be in (0, 1], got "
            f"{memory_fraction!r}."
        )
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError(
            f"size_kv_cache: {device} reports no memory limit (memory_stats() "
            f"gives {sorted(stats) or 'nothing'}); pass memory_bytes= (the bytes "
            "the KV cache and the step may use per device)."
        )
    return int(limit * memory_fraction), (
        f"{memory_fraction} x bytes_limit {limit} of {device}"
    )


@checks_own_arguments
def size_kv_cache(
    runner_config: RunnerConfig,
    compile_step: Callable[[KVCachePlan], Any],
    *,
    memory_bytes: int | None = None,
    memory_fraction: float = 0.9,
    device: Any = None,
    probe_blocks: Sequence[int] = (8, 16),
    mesh: Mesh | None = None,
    **plan_options: Any,
) -> KVCacheSizing:
    """The largest ``num_blocks`` whose compiled step fits a memory budget.

    Args:
      runner_config: The model's runner config.
      compile_step: ``compile_step(plan)`` compiles your step for `plan`'s
        pools from shapes (nothing allocated) and returns the compiled
        program (``jax.jit(step, donate_argnums=...).lower(...).compile()``)
        or its peak bytes per device; the step's weights and inputs are its
        arguments, so they count.
      memory_bytes: The budget per device for the step and its pools; or
        `memory_fraction` of the device's ``bytes_limit`` (vLLM's
        ``gpu_memory_utilization``), where the backend reports one.
      memory_fraction: See `memory_bytes`.
      device: The device whose limit is read (default: the first).
      probe_blocks: The two pool sizes compiled to fit the step's bytes.
      mesh: Plan over this mesh (:func:`shard_plan`; `compile_step` gets a
        :class:`ShardedPlan`, whose pools it compiles with their
        ``pool_sharding``): the budget and every figure are per device, and
        ``num_blocks`` is per data-parallel rank.
      plan_options: Passed to :func:`make_plan` (or :func:`shard_plan`:
        ``storage=``, ``data_axis=``, ...).

    Returns:
      A :class:`KVCacheSizing`; ``make_plan(runner_config,
      num_blocks=sizing.num_blocks, **plan_options)`` (or ``shard_plan``) is
      the plan.

    Raises:
      ValueError: If the budget holds fewer than two blocks beside the step
        (both numbers named), or no budget is known (see `memory_bytes`).

    Example:
      >>> import jax, jaxkv
      >>> cfg = jaxkv.tiny_hybrid_config()
      >>> def compile_step(plan):
      ...     step = jax.jit(lambda pools: tuple(p + 1 for p in pools),
      ...                    donate_argnums=0)
      ...     return step.lower(jax.eval_shape(plan.allocate)).compile()
      >>> sizing = jaxkv.size_kv_cache(cfg, compile_step, memory_bytes=2**21)
      >>> sizing.num_blocks, sizing.pool_bytes_per_block, sizing.step_bytes <= 2**21
      (63, 32768, True)
    """
    budget, source = _device_budget(memory_bytes, memory_fraction, device)
    small, large = _probes(probe_blocks)

    def measure(n: int) -> int:
        if mesh is None:
            plan: Any = make_plan(runner_config, num_blocks=n, **plan_options)
        else:
            plan = shard_plan(runner_config, mesh=mesh, num_blocks=n, **plan_options)
        out = compile_step(plan)
        return int(out) if is_int(out) else step_bytes(out)

    probes = [(small, measure(small)), (large, measure(large))]
    pool_per_block = _block_bytes(runner_config, {} if mesh else plan_options)
    per_block = max((probes[1][1] - probes[0][1]) // (large - small), 1)
    fixed = max(probes[0][1] - per_block * small, 0)
    n = (budget - fixed) // per_block
    # The fit is checked by compiling at its answer. A step whose bytes grow
    # faster than linearly steps down (by the overshoot, or halfway to the
    # largest count that fit) for a few compiles; the answer always fit.
    lo = max(((m, b) for m, b in probes if b <= budget), default=None)
    hi = min((m for m, b in probes if b > budget), default=None)
    for _ in range(_MAX_CHECKS):
        if hi is not None and n >= hi:
            n = hi - 1
        if n < 2 or (lo is not None and n <= lo[0]):
            break
        got = measure(n)
        probes.append((n, got))
        if got <= budget:
            lo = (n, got)
            break
        hi = n
        n -= max(1, -(-(got - budget) // per_block))
        if lo is not None:
            n = max(n, (lo[0] + hi) // 2)
    if lo is None or lo[0] < 2:
        raise ValueError(
            f"size_kv_cache: the budget of {budget} bytes per device ({source}) "
            f"holds fewer than 2 blocks: the step needs {fixed} bytes besides its "
            f"pools and each block {per_block} more (at {small} blocks the step "
            f"needs {probes[0][1]})."
        )
    return KVCacheSizing(
        num_blocks=int(lo[0]),
        budget_bytes=budget,
        budget_source=source,
        fixed_bytes=int(fixed),
        bytes_per_block=int(per_block),
        pool_bytes_per_block=int(pool_per_block),
        step_bytes=int(lo[1]),
        probes=tuple(probes),
    )


_MAX_CHECKS = 8
"""Compiles after the two probes, at most, to find a count that fits."""


def _probes(probe_blocks: Sequence[int]) -> tuple[int, int]:
    sizes = [
        check_positive_int("size_kv_cache", "probe_blocks", b) for b in probe_blocks
    ]
    if len(sizes) != 2 or not 2 <= sizes[0] < sizes[1]:
        raise ValueError(
            "size_kv_cache: probe_blocks must be two block counts, the first at "
            f"least 2 and below the second, got {tuple(probe_blocks)}."
        )
    return sizes[0], sizes[1]


def _block_bytes(runner_config: RunnerConfig, plan_options: dict[str, Any]) -> int:
    """One block's bytes over all pools (unsharded)."""
    plan = make_plan(runner_config, num_blocks=2, **plan_options)
    return sum(p.size_bytes for p in plan.pools) // 2
