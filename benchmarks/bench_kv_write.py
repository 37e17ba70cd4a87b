"""KV write: jaxkv's slot-mapping scatter through a view vs NumPy in-place assignment.

Writes `--tokens` tokens of K and V (`--heads` x `--head-dim`) into one layer of
a pool of at least `--pool-mib` MiB, donated, and compares with NumPy's in-place
fancy assignment of the same bytes, in the same run. Also prints the naive
`.at[].set` on a bf16 array for contrast.

    python benchmarks/bench_kv_write.py --pool-mib 256
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    measure_donated,
    measure_host,
    parser,
    print_table,
    write_json,
)

import jaxkv  # noqa: E402


def _layer(dtype: str, block: int, heads: int, head: int, pool_mib: int):
    spec = jaxkv.FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype
    )
    cfg = jaxkv.RunnerConfig(
        layers=[
            jaxkv.LayerConfig(
                name="l", spec=spec, backend=jaxkv.get_backend("JAX_PAGED")
            )
        ]
    )
    num_blocks = -(-pool_mib * 2**20 // spec.page_size_bytes)
    kv = jaxkv.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            jaxkv.KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=["l"])
        ],
        kv_cache_groups=[jaxkv.KVCacheGroupSpec(layer_names=["l"], kv_cache_spec=spec)],
    )
    groups, _, sizes = jaxkv.init_attn_backend(kv, cfg)
    pools, views = jaxkv.init_kv_cache(kv, cfg, sizes, groups)
    return spec, num_blocks, pools, views["l"]


def _numpy_time(key, value, slots, num_blocks, block, iters) -> float:
    word = np.uint16 if key.dtype.itemsize == 2 else np.uint8
    n = key.shape[0]
    npool = np.zeros((num_blocks, 2, block, key[0].size), word)
    kn, vn = key.view(word).reshape(n, -1), value.view(word).reshape(n, -1)
    blk, tok = slots // block, slots % block

    def numpy_write():
        npool[blk, 0, tok] = kn
        npool[blk, 1, tok] = vn

    return measure_host(numpy_write, iters=iters)


def run(args) -> dict:
    rng = np.random.default_rng(0)
    rows, results = [], {}
    n, h, d, b = args.tokens, args.heads, args.head_dim, args.block_size
    for dtype in ("bfloat16", "float8_e4m3fn"):
        spec, num_blocks, pools, view = _layer(dtype, b, h, d, args.pool_mib)
        slots = rng.choice(num_blocks * b, n, replace=False).astype(np.int32)
        key = jnp.asarray(rng.standard_normal((n, h, d)), spec.dtype)
        value = jnp.asarray(rng.standard_normal((n, h, d)), spec.dtype)
        slots_j = jnp.asarray(slots)
        compile_s, t_jax, pools = measure_donated(
            jaxkv.write_kv, pools, view, key, value, slots_j, iters=args.iters
        )
        pool_bytes = sum(p.nbytes for p in pools)
        del pools
        # NumPy: the same bytes, assigned in place into a blocks-first array.
        t_np = _numpy_time(
            np.asarray(key), np.asarray(value), slots, num_blocks, b, args.iters
        )
        written = 2 * key.nbytes
        rows.append(
            {
                "dtype": dtype,
                "impl": "numpy in-place",
                "ms": t_np * 1e3,
                "GB/s": written / t_np / 1e9,
                "ratio": 1.0,
            }
        )
        rows.append(
            {
                "dtype": dtype,
                "impl": "jaxkv.write_kv",
                "ms": t_jax * 1e3,
                "GB/s": written / t_jax / 1e9,
                "ratio": t_jax / t_np,
            }
        )
        results[dtype] = {
            "jaxkv_ms": t_jax * 1e3,
            "numpy_ms": t_np * 1e3,
            "ratio": t_jax / t_np,
            "compile_s": compile_s,
            "pool_bytes": pool_bytes,
            "bytes_written": written,
        }
    # Naive contrast: .at[].set on a bf16 array shaped like the view.
    spec, num_blocks, _, _ = _layer("bfloat16", b, h, d, args.pool_mib)
    cache = jnp.zeros((num_blocks, 2, b, h, d), jnp.bfloat16)
    slots = jnp.asarray(rng.choice(num_blocks * b, n, replace=False).astype(np.int32))
    key = jnp.asarray(rng.standard_normal((n, h, d)), jnp.bfloat16)

    @jax.jit
    def naive(cache, key, slots):
        blk, tok = slots // b, slots % b
        return cache.at[blk, 0, tok].set(key).at[blk, 1, tok].set(key)

    naive_donated = jax.jit(naive, donate_argnums=0)
    _, t_naive, cache = measure_donated(
        naive_donated, cache, key, slots, iters=max(3, args.iters // 10)
    )
    t_np = results["bfloat16"]["numpy_ms"] / 1e3
    rows.append(
        {
            "dtype": "bfloat16",
            "impl": "naive bf16 .at[].set",
            "ms": t_naive * 1e3,
            "GB/s": 2 * key.nbytes / t_naive / 1e9,
            "ratio": t_naive / t_np,
        }
    )
    results["naive_bf16_ms"] = t_naive * 1e3
    print_table(
        f"KV write: {n} tokens x {h} heads x {d}, pool {args.pool_mib} MiB", rows
    )
    print(
        f"\njaxkv / numpy (bf16): {results['bfloat16']['ratio']:.2f}x  (target <= 2.0x)"
    )
    print(f"jaxkv / numpy (fp8):  {results['float8_e4m3fn']['ratio']:.2f}x")
    print(
        f"naive bf16 / jaxkv:   {t_naive * 1e3 / results['bfloat16']['jaxkv_ms']:.0f}x"
    )
    return results


def main(argv=None) -> dict:
    p = parser("KV write: jaxkv's slot-mapping scatter vs NumPy in-place assignment.")
    p.add_argument("--pool-mib", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_kv_write",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
