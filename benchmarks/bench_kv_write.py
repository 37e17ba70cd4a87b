"""KV write: jaxkv's slot-mapping scatter through a view vs NumPy in-place assignment.

Writes `--tokens` tokens of K and V (`--heads` x `--head-dim`) into one layer of
a pool of at least `--pool-mib` MiB, donated, and compares with NumPy's in-place
fancy assignment of the same bytes, in the same run. Also prints the naive
`.at[].set` on a bf16 array for contrast, and two rows that locate the cost:

- "pipelined": the same write called `--calls` times back to back, one wait
  (a step loop's pattern: the caller is woken once per round, not per call);
- "one-kernel floor": the same scatter with its word offsets and carrier words
  computed beforehand, so the program is a single scatter kernel. XLA:CPU runs
  such a program inline on the caller's thread; a write also has to convert
  bf16/fp8 to carrier words and slots to offsets, two more kernels, and on this
  2-core VM each costs a thread hand-off of tens of microseconds.

    python benchmarks/bench_kv_write.py --pool-mib 256
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    default_implementation,
    measure_donated,
    measure_host,
    measure_pipelined,
    paged_layers,
    parser,
    print_table,
    write_json,
)

import jaxkv  # noqa: E402

# jaxkv's C++ write on CPU (opt-in, named), the platform's choice elsewhere.
IMPLEMENTATION = default_implementation()


@functools.partial(jax.jit, donate_argnums=0)
def write_kv(pools, view, key, value, slots):
    """``jaxkv.write_kv`` on this platform's benchmarked kernel (jitted, donated)."""
    return jaxkv.write_kv(pools, view, key, value, slots, implementation=IMPLEMENTATION)


from jaxkv.kv._ops import _plan  # noqa: E402
from jaxkv.kv._strided import _starts, to_bits, to_words  # noqa: E402

_ROWS = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
)


def _layers(
    dtype: str,
    block: int,
    heads: int,
    head: int,
    pool_mib: int,
    count: int,
    storage: str = "words",
):
    """`count` full-attention layers, one pool each (or one stacked pool),
    `pool_mib` MiB in all."""
    page = 2 * block * heads * head * np.dtype(jnp.dtype(dtype)).itemsize
    num_blocks = -(-pool_mib * 2**20 // (page * count))
    _, _, pools, views = paged_layers(
        dtype, block, heads, head, num_blocks, count, storage=storage
    )
    return views[0].dtype, num_blocks, pools, views


def _layer(
    dtype: str, block: int, heads: int, head: int, pool_mib: int, storage="words"
):
    dt, num_blocks, pools, views = _layers(
        dtype, block, heads, head, pool_mib, 1, storage
    )
    return dt, num_blocks, pools, views[0]


@functools.partial(jax.jit, donate_argnums=0)
def _write_step(pools, views, keys, values, slots):
    """One step's writes: every layer's K/V in one program, as a model step does."""
    for i, view in enumerate(views):
        pools = jaxkv.write_kv(
            pools, view, keys[i], values[i], slots, implementation=IMPLEMENTATION
        )
    return pools


def _step_writes(args, dtype: str, rng, storage: str = "words") -> dict:
    """A step's K/V writes of `--layers` layers, one program, vs NumPy's loop."""
    n, h, d, b, count = (
        args.tokens,
        args.heads,
        args.head_dim,
        args.block_size,
        args.layers,
    )
    dt, num_blocks, pools, views = _layers(
        dtype, b, h, d, args.pool_mib, count, storage
    )
    slots = rng.choice(num_blocks * b, n, replace=False).astype(np.int32)
    # Each layer's K/V its own array, as a model's projections make them (a
    # slice of one stacked input would be one more copy kernel per layer for
    # a custom call, which cannot fuse it).
    keys = tuple(jnp.asarray(rng.standard_normal((n, h, d)), dt) for _ in range(count))
    values = tuple(
        jnp.asarray(rng.standard_normal((n, h, d)), dt) for _ in range(count)
    )
    _, t_jax, pools = measure_donated(
        _write_step, pools, views, keys, values, jnp.asarray(slots), iters=args.iters
    )
    del pools
    word = np.uint16 if keys[0].dtype.itemsize == 2 else np.uint8
    npools = [np.zeros((num_blocks, 2, b, h * d), word) for _ in range(count)]
    kn = np.stack([np.asarray(k) for k in keys]).view(word).reshape(count, n, -1)
    vn = np.stack([np.asarray(v) for v in values]).view(word).reshape(count, n, -1)

    def numpy_step():
        blk, tok = slots // b, slots % b
        for i, npool in enumerate(npools):
            npool[blk, 0, tok] = kn[i]
            npool[blk, 1, tok] = vn[i]

    t_np = measure_host(numpy_step, iters=args.iters)
    return {"jaxkv_ms": t_jax * 1e3, "numpy_ms": t_np * 1e3, "ratio": t_jax / t_np}


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


@jax.jit
def _precompute(pools, view, key, value, slots):
    """jaxkv's own word offsets and carrier words of a K/V write (not timed)."""
    pool = pools[view.pool]
    plan = _plan(view, (view.block_dim, view.dim("token"), view.dim("kv")))
    k, n = view.block_size, slots.shape[0]
    block, token = jnp.tile(slots // k, 2), jnp.tile(slots % k, 2)
    halves = jnp.repeat(jnp.arange(2, dtype=jnp.int32), n)
    limits = (view.shape[view.block_dim], k, 2)
    starts = _starts(plan, (block, token, halves), limits, pool.shape)
    data = jnp.concatenate([key, value]).astype(view.dtype)
    bits = to_bits(data)
    rows = jnp.transpose(bits, plan.data_perm).reshape(starts.shape[0], -1)
    return starts, to_words(rows, pool.dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _one_kernel_scatter(pool, starts, words):
    return lax.scatter(
        pool, starts, words, _ROWS, mode=lax.GatherScatterMode.FILL_OR_DROP
    )


def run(args) -> dict:
    rng = np.random.default_rng(0)
    rows, results = [], {}
    n, h, d, b = args.tokens, args.heads, args.head_dim, args.block_size
    for dtype in ("bfloat16", "float8_e4m3fn"):
        dt, num_blocks, pools, view = _layer(dtype, b, h, d, args.pool_mib)
        slots = rng.choice(num_blocks * b, n, replace=False).astype(np.int32)
        key = jnp.asarray(rng.standard_normal((n, h, d)), dt)
        value = jnp.asarray(rng.standard_normal((n, h, d)), dt)
        slots_j = jnp.asarray(slots)
        compile_s, t_jax, pools = measure_donated(
            write_kv, pools, view, key, value, slots_j, iters=args.iters
        )
        compiled = jaxkv.write_kv.lower(
            pools, view, key, value, slots_j, implementation=IMPLEMENTATION
        ).compile()
        t_pipe, pools = measure_pipelined(
            compiled, pools, view, key, value, slots_j, calls=args.calls
        )
        starts, words = _precompute(pools, view, key, value, slots_j)
        index = view.pool
        _, t_floor, pool = measure_donated(
            _one_kernel_scatter, pools[index], starts, words, iters=args.iters
        )
        pools = (*pools[:index], pool, *pools[index + 1 :])
        pool_bytes = sum(p.nbytes for p in pools)
        del pools
        # The same write into a typed pool (make_plan(storage="typed"); on CPU
        # a bf16/fp8 pool holds its bits as uint16/uint8, pool_dtype="auto").
        _, _, typed_pools, typed_view = _layer(
            dtype, b, h, d, args.pool_mib, storage="typed"
        )
        _, t_typed, typed_pools = measure_donated(
            write_kv,
            typed_pools,
            typed_view,
            key,
            value,
            slots_j,
            iters=args.iters,
        )
        del typed_pools
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
        for impl, t in (
            ("jaxkv.write_kv, word pool", t_jax),
            ("jaxkv.write_kv, typed pool", t_typed),
            ("jaxkv.write_kv pipelined", t_pipe),
            ("one-kernel floor", t_floor),
        ):
            rows.append(
                {
                    "dtype": dtype,
                    "impl": impl,
                    "ms": t * 1e3,
                    "GB/s": written / t / 1e9,
                    "ratio": t / t_np,
                }
            )
        step = _step_writes(args, dtype, rng)
        stacked = _step_writes(args, dtype, rng, storage="stacked")
        rows.append(
            {
                "dtype": dtype,
                "impl": f"numpy, {args.layers} layers",
                "ms": step["numpy_ms"],
                "GB/s": args.layers * written / step["numpy_ms"] / 1e6,
                "ratio": 1.0,
            }
        )
        for impl, st in (("word pools", step), ("one stacked pool", stacked)):
            rows.append(
                {
                    "dtype": dtype,
                    "impl": f"jaxkv, {args.layers} layers, 1 program, {impl}",
                    "ms": st["jaxkv_ms"],
                    "GB/s": args.layers * written / st["jaxkv_ms"] / 1e6,
                    "ratio": st["jaxkv_ms"] / step["numpy_ms"],
                }
            )
        results[dtype] = {
            "step": step,
            "stacked_step": stacked,
            "typed_ms": t_typed * 1e3,
            "typed_ratio": t_typed / t_np,
            "jaxkv_ms": t_jax * 1e3,
            "numpy_ms": t_np * 1e3,
            "ratio": t_jax / t_np,
            "pipelined_ms": t_pipe * 1e3,
            "pipelined_ratio": t_pipe / t_np,
            "floor_ms": t_floor * 1e3,
            "floor_ratio": t_floor / t_np,
            "compile_s": compile_s,
            "pool_bytes": pool_bytes,
            "bytes_written": written,
        }
    # Naive contrast: .at[].set on a bf16 array shaped like the view.
    _, num_blocks, _, _ = _layer("bfloat16", b, h, d, args.pool_mib)
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
    for dtype in ("bfloat16", "float8_e4m3fn"):
        r = results[dtype]
        print(
            f"\njaxkv / numpy ({dtype}): word pool {r['ratio']:.2f}x, typed pool "
            f"{r['typed_ratio']:.2f}x  (target <= 2.0x)"
        )
    for dtype in ("bfloat16", "float8_e4m3fn"):
        r = results[dtype]
        print(
            f"{dtype}: one step's writes of {args.layers} layers in one program "
            f"{r['step']['ratio']:.2f}x numpy's (word pools), "
            f"{r['stacked_step']['jaxkv_ms'] / r['step']['numpy_ms']:.2f}x (one "
            "stacked pool)  (target <= 2.0x)"
        )
        print(
            f"{dtype}: pipelined {r['pipelined_ratio']:.2f}x, one-kernel floor "
            f"{r['floor_ratio']:.2f}x of numpy"
        )
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
    p.add_argument("--layers", type=int, default=8, help="layers per step")
    p.add_argument("--calls", type=int, default=20, help="calls per pipelined round")
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
