"""Scaling: attention step time and memory against requests, context and pool size.

Three sweeps of the paged decode attention (and the KV write): the number of
requests, the context length, and the pool size with the batch fixed. Reads
and writes must stay flat in pool size: they touch only the bytes they need.
Writes `scaling.png` next to the JSON when matplotlib is installed.

    python benchmarks/bench_scaling.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import measure, measure_donated, parser, print_table, write_json  # noqa: E402
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


def _pool_point(args: Any, pool_mib: int) -> dict[str, float]:
    """Write 256 tokens and read a 32 x 512 decode batch in a pool of `pool_mib`."""
    page, hk, d = args.page, args.num_kv_heads, args.head_dim
    spec = jaxkv.FullAttentionSpec(
        block_size=page, num_kv_heads=hk, head_size=d, dtype=args.dtype
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="l", spec=spec, backend=jaxkv.get_backend("JAX_PAGED")
            )
        ]
    )
    num_blocks = max(pool_mib * 2**20 // spec.page_size_bytes, 2048)
    kv = jaxkv.make_kv_cache_config(cfg, num_blocks=int(num_blocks))
    groups, _, sizes = jaxkv.init_attn_backend(kv, cfg)
    pools, views = jaxkv.init_kv_cache(kv, cfg, sizes, groups)
    view = views["l"]
    rng = np.random.default_rng(0)
    slots = jnp.asarray(
        rng.choice(int(num_blocks) * page, 256, replace=False).astype(np.int32)
    )
    k = jnp.asarray(rng.standard_normal((256, hk, d)), jnp.dtype(args.dtype))
    _, t_write, pools = measure_donated(
        jaxkv.write_kv, pools, view, k, k, slots, iters=args.iters
    )
    tables = jnp.asarray(
        rng.integers(1, int(num_blocks), (32, 512 // page)).astype(np.int32)
    )
    meta = jaxkv.build_attn_metadata(
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
    )["l"]
    q = jnp.asarray(rng.standard_normal((32, args.num_heads, d)), jnp.dtype(args.dtype))
    fn = jax.jit(
        lambda q, pools, meta: jaxkv.paged_attention(
            q, pools, view, meta, scale=d**-0.5
        )
    )
    _, t_read = measure(fn, q, pools, meta, iters=args.iters)
    pool_bytes = sum(p.nbytes for p in pools)
    del pools
    return {
        "pool_MiB": pool_bytes / 2**20,
        "write_ms": t_write * 1e3,
        "attention_ms": t_read * 1e3,
    }


def run(args: Any) -> dict[str, Any]:
    reqs = [
        _attention_point(args, r, args.context) | {"requests": r} for r in args.requests
    ]
    print_table(f"Decode attention vs requests (context {args.context})", reqs)
    ctxs = [
        _attention_point(args, args.num_reqs, c) | {"context": c} for c in args.contexts
    ]
    print_table(f"Decode attention vs context ({args.num_reqs} requests)", ctxs)
    pools = [_pool_point(args, m) for m in args.pool_mib]
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
    try:
        import matplotlib  # pyright: ignore[reportMissingImports]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]
    except ImportError:
        return False
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
    fig.suptitle(f"jaxkv scaling ({jax.default_backend()})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return True


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Attention and KV-write scaling.")
    p.add_argument("--requests", type=_ints, default=[8, 32, 128, 256])
    p.add_argument("--contexts", type=_ints, default=[128, 512, 2048, 8192])
    p.add_argument("--pool-mib", type=_ints, default=[64, 256, 1024])
    p.add_argument("--num-reqs", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dtype", default="float32")
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
