"""Run by tests/test_sizing.py in a subprocess with 8 simulated CPU devices.

``size_kv_cache`` on a 2x4 mesh (data x tensor) and on one device, the same
per-device budget: the step compiled with the sharded pools reports each
device's bytes, so a block costs a device its tensor rank's share (a quarter
of the single-device figure: its heads), and the mesh fits about four times
the blocks per data rank.

Prints ``OK`` on success; any failure raises.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":  # never when pytest imports this file for doctests
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

import jaxkv  # noqa: E402


def _compile_step(plan):
    step = jax.jit(lambda pools: tuple(p + 1 for p in pools), donate_argnums=0)
    sharding = getattr(plan, "pool_sharding", None)
    pools = [
        jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding)
        for p in jax.eval_shape(plan.allocate)
    ]
    return step.lower(pools).compile()


def main() -> None:
    cfg = jaxkv.llama_like_config(
        num_layers=2, num_heads=8, num_kv_heads=4, token_buckets=(16,)
    )
    budget = 2**22
    one = jaxkv.size_kv_cache(cfg, _compile_step, memory_bytes=budget)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    sharded = jaxkv.size_kv_cache(cfg, _compile_step, memory_bytes=budget, mesh=mesh)
    assert sharded.bytes_per_block * 4 == one.bytes_per_block, (sharded, one)
    assert sharded.pool_bytes_per_block == one.pool_bytes_per_block
    assert sharded.step_bytes <= budget
    ratio = sharded.num_blocks / one.num_blocks
    assert 3.9 <= ratio <= 4.1, (sharded.num_blocks, one.num_blocks)
    print(one.num_blocks, sharded.num_blocks)
    print("OK")


if __name__ == "__main__":
    main()
