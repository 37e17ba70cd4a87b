"""Scaling: attention step time and memory against requests, context and pool size.

Three sweeps of the paged decode attention (and the KV write): the number of
requests, the context length, and the pool size with the batch fixed (pool
sizes are measured in interleaved rounds, so the machine's noise is shared). Reads
and writes must stay flat in pool size: they touch only the bytes they need.
Writes `scaling.png` next to the JSON when matplotlib is installed.

    python benchmarks/bench_scaling.py
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    add_attention_shape_args,
    measure,
    paged_layers,
    parser,
    print_table,
    write_json,
)
from bench_attention import Batch  # noqa: E402

import jaxkv  # noqa: E402


def _attention_point(args: Any, num_reqs: int, context: int) -> dict[str, float]:
    batch = Batch(args, [1] * num_reqs, [context] * num_reqs)
    view = batch.view
    fn = jax.jit(
        lambda q, pools, meta: jaxkv.paged_attention(
            q, pools, view, meta, scale=args.head_dim**-0.5
        )
    )
    compiled = fn.lower(batch.q, batch.pools, batch.meta).compile()
    _, t = measure(fn, batch.q, batch.pools, batch.meta, iters=args.iters)
    analysis = compiled.memory_analysis()
    temp = analysis.temp_size_in_bytes if analysis is not None else 0
    return {"ms": t * 1e3, "temp_MiB": temp / 2**20, "kv_MiB": batch.kv_bytes / 2**20}


class _PoolPoint:
    """A 256-token write and a 32 x 512 decode read in a pool of `pool_mib` MiB."""

    def __init__(self, args: Any, pool_mib: int) -> None:
        page, hk, d = args.page, args.num_kv_heads, args.head_dim
        page_bytes = 2 * page * hk * d * np.dtype(jnp.dtype(args.dtype)).itemsize
        # At least room for the 256 written tokens; no larger floor, so every
        # requested size is the size measured (a floor used to merge points).
        num_blocks = int(max(pool_mib * 2**20 // page_bytes, 256 // page + 2))
        kv, groups, self.pools, views = paged_layers(
            args.dtype, page, hk, d, num_blocks
        )
        view = views[0]
        rng = np.random.default_rng(0)
        self.slots = jnp.asarray(
            rng.choice(num_blocks * page, 256, replace=False).astype(np.int32)
        )
        self.k = jnp.asarray(rng.standard_normal((256, hk, d)), jnp.dtype(args.dtype))
        self.write = jaxkv.write_kv.lower(
            self.pools, view, self.k, self.k, self.slots
        ).compile()
        self.view = view
        tables = jnp.asarray(
            rng.integers(1, num_blocks, (32, 512 // page)).astype(np.int32)
        )
        self.meta = jaxkv.vllm.build_attn_metadata(
            groups,
            32,
            32,
            np.arange(33, dtype=np.int32),
            None,
            1,
            np.full(32, 512, np.int32),
            512,
            [tables],
            [np.full(32, -1, np.int32)],
            kv,
        )["layers.0"]
        self.q = jnp.asarray(
            rng.standard_normal((32, args.num_heads, d)), jnp.dtype(args.dtype)
        )
        self.read = (
            jax.jit(
                lambda q, pools, meta: jaxkv.paged_attention(
                    q, pools, view, meta, scale=d**-0.5
                )
            )
            .lower(self.q, self.pools, self.meta)
            .compile()
        )
        self.pool_bytes = sum(p.nbytes for p in self.pools)
        self.write_s: list[float] = []
        self.read_s: list[float] = []

    def sample(self, iters: int) -> None:
        """Appends `iters` timed writes and reads."""
        for _ in range(iters):
            t0 = time.perf_counter()
            self.pools = jax.block_until_ready(
                self.write(self.pools, self.view, self.k, self.k, self.slots)
            )
            t1 = time.perf_counter()
            jax.block_until_ready(self.read(self.q, self.pools, self.meta))
            t2 = time.perf_counter()
            self.write_s.append(t1 - t0)
            self.read_s.append(t2 - t1)


def _pool_sweep(args: Any) -> list[dict[str, float]]:
    """Pool sizes measured in interleaved rounds, so machine noise hits all alike."""
    points = [_PoolPoint(args, m) for m in args.pool_mib]
    sizes = [p.pool_bytes for p in points]
    if len(points) < 2 or len(set(sizes)) != len(sizes):
        raise ValueError(
            f"--pool-mib {args.pool_mib}: the pool-size sweep needs at least two "
            f"distinct pool sizes; got pools of {sizes} bytes"
        )
    for point in points:
        point.sample(2)  # warm-up
        point.write_s.clear()
        point.read_s.clear()
    rounds = 10
    for _ in range(rounds):
        for point in points:
            point.sample(max(1, args.iters // rounds))
    return [
        {
            "pool_MiB": p.pool_bytes / 2**20,
            "write_ms": statistics.median(p.write_s) * 1e3,
            "attention_ms": statistics.median(p.read_s) * 1e3,
        }
        for p in points
    ]


def run(args: Any) -> dict[str, Any]:
    reqs = [
        _attention_point(args, r, args.context) | {"requests": r} for r in args.requests
    ]
    print_table(f"Decode attention vs requests (context {args.context})", reqs)
    ctxs = [
        _attention_point(args, args.num_reqs, c) | {"context": c} for c in args.contexts
    ]
    print_table(f"Decode attention vs context ({args.num_reqs} requests)", ctxs)
    pools = _pool_sweep(args)
    print_table(
        "KV write (256 tokens) and decode attention (32 x 512) vs pool size", pools
    )
    spread_w = max(p["write_ms"] for p in pools) / min(p["write_ms"] for p in pools)
    spread_r = max(p["attention_ms"] for p in pools) / min(
        p["attention_ms"] for p in pools
    )
    growth = pools[-1]["pool_MiB"] / pools[0]["pool_MiB"]
    print(
        f"\npool grows {growth:.0f}x: write time varies {spread_w:.2f}x, attention "
        f"{spread_r:.2f}x (target: flat)"
    )
    return {
        "requests": reqs,
        "context": ctxs,
        "pool": pools,
        "write_spread": spread_w,
        "read_spread": spread_r,
    }


def plot(results: dict[str, Any], path: Path) -> bool:
    """Saves the three sweeps as one figure; False if matplotlib is missing."""
    try:  # optional (the pictures extra)
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return False
    matplotlib.use("Agg")
    from jaxkv.pictures import plot_scaling

    fig = plot_scaling(results, title=f"jaxkv scaling ({jax.default_backend()})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return True


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Attention and KV-write scaling.")
    p.add_argument("--requests", type=_ints, default=[8, 32, 128, 256])
    p.add_argument("--contexts", type=_ints, default=[128, 512, 2048, 8192])
    p.add_argument("--pool-mib", type=_ints, default=[64, 256, 1024, 4096])
    p.add_argument("--num-reqs", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    add_attention_shape_args(p)
    p.add_argument("--plot", type=Path, default=None, help="figure path (PNG)")
    args = p.parse_args(argv)
    results = run(args)
    if args.plot is not None and plot(results, args.plot):
        print(f"plot: {args.plot}")
    write_json(
        args.json,
        "bench_scaling",
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
