"""Paged attention through views vs ejkernel's ragged_page_attention_v3, XLA fallback.

Decode batch (default 32 requests x 512 context, 8 query heads, 2 KV heads,
head 128, page 16, fp32). Both sides do the same work in one jitted call: write
the step's new K/V into the cache, then attend over it. jaxkv: `write_kv` then
`paged_attention` reading K/V through a layer view. ejkernel (benchmark only:
`pip install --no-deps ejkernel` plus beartype jaxtyping pydantic einops tqdm):
`ejkernel.kernels._xla.ragged_page_attention_v3`, its pure-XLA fallback (not a
Pallas or Triton kernel), which also writes the new K/V into its cache before
attending. Plus one jitted pass over as many bytes as the decode reads (the
same harness: dispatch and wait, on every platform).
Then a mixed batch (4 prefills of 37-300 tokens + 28 decodes) whose outputs
are checked against ejkernel's.

    python benchmarks/bench_attention.py
"""

from __future__ import annotations

import functools
import importlib
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
    default_implementation,
    measure_donated,
    paged_layers,
    parser,
    print_table,
    write_json,
)

import jaxkv  # noqa: E402

# Benchmark-only peer, never a dependency of jaxkv; imported by name so type
# checks pass with and without it installed.
ragged_page_attention_v3: Any = None
try:
    ragged_page_attention_v3 = importlib.import_module(
        "ejkernel.kernels._xla.ragged_page_attention_v3"
    ).ragged_page_attention_v3
except Exception as err:  # noqa: BLE001
    EJKERNEL_ERROR = f"{type(err).__name__}: {err}"
else:
    EJKERNEL_ERROR = ""


class Batch:
    """One layer's cache holding random K/V for a ragged batch, in both layouts."""

    def __init__(
        self,
        args: Any,
        q_lens: list[int],
        ctx_lens: list[int],
        seed: int = 0,
        storage: str = "words",
        tensor_layout: str | None = None,
    ):
        rng = np.random.default_rng(seed)
        dtype = np.dtype(jnp.dtype(args.dtype))
        page, hk, d = args.page, args.num_kv_heads, args.head_dim
        width = max(-(-c // page) for c in ctx_lens)
        num_blocks = len(ctx_lens) * width + 1
        kv, groups, self.pools, views = paged_layers(
            args.dtype,
            page,
            hk,
            d,
            num_blocks,
            storage=storage,
            tensor_layout=tensor_layout,
        )
        self.view = views[0]
        perm = 1 + rng.permutation(num_blocks - 1)
        self.tables = (
            perm[: len(ctx_lens) * width].reshape(len(ctx_lens), width).astype(np.int32)
        )
        self.k = [rng.standard_normal((c, hk, d)).astype(dtype) for c in ctx_lens]
        self.v = [rng.standard_normal((c, hk, d)).astype(dtype) for c in ctx_lens]
        # ejkernel's packed cache: (pages, page, 2*H / packing, packing, D), K and
        # V of each head interleaved; `packing` elements share 32 bits.
        self.packing = max(1, 4 // dtype.itemsize)
        self.ej_cache = np.zeros((num_blocks, page, 2 * hk, d), dtype)
        for r, c in enumerate(ctx_lens):
            pos = np.arange(c)
            slots = self.tables[r][pos // page] * page + pos % page
            self.pools = jaxkv.write_kv(
                self.pools, self.view, self.k[r], self.v[r], slots
            )
            blk, off = self.tables[r][pos // page], pos % page
            self.ej_cache[blk, off, 0::2] = self.k[r]
            self.ej_cache[blk, off, 1::2] = self.v[r]
        self.ej_cache = self.ej_cache.reshape(
            num_blocks, page, 2 * hk // self.packing, self.packing, d
        )
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.qsl, self.ctx = qsl, np.asarray(ctx_lens, np.int32)
        self.q = jnp.asarray(
            rng.standard_normal((int(qsl[-1]), args.num_heads, d)), dtype
        )
        self.meta = jaxkv.vllm.build_attn_metadata(
            groups,
            len(q_lens),
            int(qsl[-1]),
            qsl,
            None,
            max(q_lens),
            self.ctx,
            max(ctx_lens),
            [self.tables],
            [np.full(int(qsl[-1]), -1, np.int32)],
            kv,
        )["layers.0"]
        # The new tokens' K/V (the last q_len positions), which ejkernel writes.
        self.new_k = np.concatenate(
            [k[c - q :] for k, c, q in zip(self.k, ctx_lens, q_lens, strict=True)]
        )
        self.new_v = np.concatenate(
            [v[c - q :] for v, c, q in zip(self.v, ctx_lens, q_lens, strict=True)]
        )
        # Their slots in jaxkv's pool: jaxkv writes them as ejkernel does.
        self.new_slots = np.concatenate(
            [
                self.tables[r][pos // page] * page + pos % page
                for r, (c, q) in enumerate(zip(ctx_lens, q_lens, strict=True))
                for pos in [np.arange(c - q, c)]
            ]
        ).astype(np.int32)
        self.kv_bytes = sum(
            k.nbytes + v.nbytes for k, v in zip(self.k, self.v, strict=True)
        )

    def jaxkv_fn(
        self,
        scale: float,
        pages_per_chunk: int = 4,
        query_tile: int = 1,
        contraction: str = "auto",
        implementation: str | None = "default",
    ) -> Any:
        """``state = (pools, out) -> (pools', out')``: write the new K/V, attend.

        The pools are donated, as in a step loop: no copy of the cache.
        """
        view = self.view
        if implementation == "default":
            implementation = default_implementation()
        # The C++ decode kernel takes rows of one token; a mixed batch's
        # prefill rows go to XLA's path.
        attend = (
            "xla" if implementation == "native" and query_tile > 1 else implementation
        )

        def step(state: Any, q: Any, meta: Any, new_k: Any, new_v: Any, slots: Any):
            pools, _ = state
            pools = jaxkv.write_kv(
                pools, view, new_k, new_v, slots, implementation=implementation
            )
            out = jaxkv.paged_attention(
                q,
                pools,
                view,
                meta,
                scale=scale,
                pages_per_chunk=pages_per_chunk,
                query_tile=query_tile,
                contraction=contraction,
                implementation=attend,
            )
            return pools, out

        return jax.jit(step, donate_argnums=0)

    def jaxkv_state(self) -> Any:
        """A fresh copy of the pools (donated by each run) and an output slot."""
        out = jnp.zeros((*self.q.shape[:2], self.q.shape[2]), self.q.dtype)
        return tuple(jnp.copy(p) for p in self.pools), out

    def jaxkv_args(self) -> tuple[Any, ...]:
        return (
            self.q,
            self.meta,
            jnp.asarray(self.new_k),
            jnp.asarray(self.new_v),
            jnp.asarray(self.new_slots),
        )

    def ejkernel_state(self) -> Any:
        out = jnp.zeros((*self.q.shape[:2], self.q.shape[2]), self.q.dtype)
        return jnp.asarray(self.ej_cache), out

    def ejkernel_args(self) -> tuple[Any, ...]:
        n = len(self.ctx)
        return (
            self.q,
            jnp.asarray(self.new_k),
            jnp.asarray(self.new_v),
            jnp.asarray(self.ctx),
            jnp.asarray(self.tables.reshape(-1)),
            jnp.asarray(self.qsl),
            jnp.asarray([0, n, n], jnp.int32),
        )


def _ejkernel_fn(scale: float) -> Any:
    """``state = (cache, out) -> (cache', out')`` through ejkernel, or None.

    ejkernel's XLA fallback writes the new K/V into its cache and attends; its
    cache is donated like jaxkv's pools.
    """
    rpa = ragged_page_attention_v3
    if rpa is None:
        return None

    def step(state: Any, q: Any, k: Any, v: Any, *rest: Any) -> Any:
        cache, _ = state
        out, cache = rpa(q, k, v, cache, *rest, softmax_scale=scale)
        return cache, out

    return jax.jit(step, donate_argnums=0)


def _try_ejkernel(batch: Batch, scale: float, iters: int) -> tuple[float, Any] | str:
    """(seconds, outputs) of ejkernel on `batch`, or why it could not run."""
    ej = _ejkernel_fn(scale)
    if ej is None:
        return f"ejkernel not installed ({EJKERNEL_ERROR})"
    try:
        _, t, state = measure_donated(
            ej, batch.ejkernel_state(), *batch.ejkernel_args(), iters=iters
        )
        return t, np.asarray(state[1])
    except Exception as err:  # noqa: BLE001 - a peer's limits, e.g. head_dim % 128
        return f"ejkernel failed: {type(err).__name__}: {err}"


def _copy_time(nbytes: int, iters: int) -> float:
    """One jitted pass that reads `nbytes` and writes `nbytes`, on every platform.

    Like for like with the attention step: an XLA program over a device array,
    dispatched and waited for through the same harness, its buffer donated as
    the pools are (``x + 1`` in place streams the bytes once each way; without
    donation each call pays the page faults of a fresh output, 10 ms for these
    32 MiB on XLA:CPU, and a gather of the pages measures XLA:CPU's gather loop,
    50 ms).
    """
    x = jnp.ones(nbytes // 4, jnp.float32)
    return measure_donated(_stream, x, iters=iters)[1]


@functools.partial(jax.jit, donate_argnums=0)
def _stream(x: jax.Array) -> jax.Array:
    return x + 1


def run(args: Any) -> dict[str, Any]:
    scale = args.head_dim**-0.5
    if args.typed_only:
        return _typed_only(args, scale)
    iters_peer = max(3, args.iters // 4)
    decode = Batch(args, [1] * args.num_reqs, [args.context] * args.num_reqs)
    fn = decode.jaxkv_fn(scale, args.pages_per_chunk)
    compile_s, t_jaxkv, state = measure_donated(
        fn, decode.jaxkv_state(), *decode.jaxkv_args(), iters=args.iters
    )
    # The same step on a typed pool (make_plan(storage="typed"); on CPU a bf16
    # pool holds uint16 bits, pool_dtype="auto").
    typed = Batch(
        args, [1] * args.num_reqs, [args.context] * args.num_reqs, storage="typed"
    )
    _, t_typed, typed_state = measure_donated(
        typed.jaxkv_fn(scale, args.pages_per_chunk),
        typed.jaxkv_state(),
        *typed.jaxkv_args(),
        iters=args.iters,
    )
    # The same step on vLLM 0.33's LHBNC tensor view (heads outermost: a
    # head's keys of one page are a whole layer's head apart from the next
    # head's), which the kernel must read as fast as a block-outermost page.
    lhbnc = Batch(
        args,
        [1] * args.num_reqs,
        [args.context] * args.num_reqs,
        tensor_layout="LHBNC",
    )
    _, t_lhbnc, lhbnc_state = measure_donated(
        lhbnc.jaxkv_fn(scale, args.pages_per_chunk),
        lhbnc.jaxkv_state(),
        *lhbnc.jaxkv_args(),
        iters=args.iters,
    )
    # The same word-pool step on XLA's own path (dot products over gathered
    # pages): implementation="xla".
    _, t_xla, _ = measure_donated(
        decode.jaxkv_fn(
            scale, args.pages_per_chunk, contraction="dot", implementation="xla"
        ),
        decode.jaxkv_state(),
        *decode.jaxkv_args(),
        iters=args.iters,
    )
    # Which kernels the word and typed pools' steps ran, read off their HLO.
    path = _kernels(fn, decode)
    typed_path = _kernels(typed.jaxkv_fn(scale, args.pages_per_chunk), typed)
    t_copy = _copy_time(decode.kv_bytes, args.iters)
    rows = [
        {
            "impl": "copy of the KV bytes read",
            "ms": t_copy * 1e3,
            "vs jaxkv": t_copy / t_jaxkv,
        },
        {
            "impl": "jaxkv write_kv + paged_attention, word pool",
            "ms": t_jaxkv * 1e3,
            "vs jaxkv": 1.0,
        },
        {
            "impl": "jaxkv write_kv + paged_attention, typed pool",
            "ms": t_typed * 1e3,
            "vs jaxkv": t_typed / t_jaxkv,
        },
        {
            "impl": "jaxkv, word pool of a vLLM 0.33 LHBNC tensor",
            "ms": t_lhbnc * 1e3,
            "vs jaxkv": t_lhbnc / t_jaxkv,
        },
        {
            "impl": "jaxkv, word pool, XLA's path (contraction='dot')",
            "ms": t_xla * 1e3,
            "vs jaxkv": t_xla / t_jaxkv,
        },
    ]
    results: dict[str, Any] = {
        "jaxkv_ms": t_jaxkv * 1e3,
        "typed_ms": t_typed * 1e3,
        "copy_ms": t_copy * 1e3,
        "jaxkv_over_copy": t_jaxkv / t_copy,
        "typed_over_copy": t_typed / t_copy,
        "lhbnc_ms": t_lhbnc * 1e3,
        "lhbnc_over_words": t_lhbnc / t_jaxkv,
        "lhbnc_equals_words": bool(
            np.array_equal(np.asarray(state[1]), np.asarray(lhbnc_state[1]))
        ),
        "xla_path_ms": t_xla * 1e3,
        "xla_path_over_copy": t_xla / t_copy,
        "decode_path": path,
        "typed_decode_path": typed_path,
        "typed_equals_words": bool(
            np.array_equal(np.asarray(state[1]), np.asarray(typed_state[1]))
        ),
        "kv_bytes": decode.kv_bytes,
        "compile_s": compile_s,
    }
    peer = _try_ejkernel(decode, scale, iters_peer)
    if isinstance(peer, str):
        results["ejkernel"] = peer
    else:
        t_ej, want = peer
        rows.insert(
            1,
            {
                "impl": "ejkernel ragged_page_attention_v3, XLA fallback",
                "ms": t_ej * 1e3,
                "vs jaxkv": t_ej / t_jaxkv,
            },
        )
        got = np.asarray(state[1])
        results.update(
            ejkernel_ms=t_ej * 1e3,
            ejkernel_over_jaxkv=t_ej / t_jaxkv,
            decode_max_abs_diff=float(np.abs(got - want).max()),
        )
    print_table(
        f"Paged decode attention: {args.num_reqs} x {args.context} context, "
        f"{args.num_heads}/{args.num_kv_heads} heads, head {args.head_dim}, page "
        f"{args.page}, {args.dtype}; kernels: word pool {path}, typed pool "
        f"{typed_path}",
        rows,
    )
    target = 3 if jnp.dtype(args.dtype) == jnp.float32 else 5
    print(
        f"\njaxkv / copy of KV bytes: word pool {t_jaxkv / t_copy:.2f}x, typed pool "
        f"{t_typed / t_copy:.2f}x  (target <= {target}x); typed outputs equal word "
        f"outputs: {results['typed_equals_words']}"
    )
    print(
        f"vLLM 0.33 LHBNC tensor view / block-outermost word pool: "
        f"{t_lhbnc / t_jaxkv:.2f}x (target <= 1.5x); outputs equal: "
        f"{results['lhbnc_equals_words']}"
    )
    if isinstance(peer, str):
        print(f"skipped: {peer}")
    else:
        print(
            f"ejkernel (XLA fallback) / jaxkv: {results['ejkernel_over_jaxkv']:.2f}x"
            "  (target >= 2.5x)"
        )
    # Mixed batch: 4 prefills of 37-300 tokens + decodes, checked against ejkernel.
    rng = np.random.default_rng(1)
    n_pre = min(4, args.num_reqs)
    q_lens = [int(x) for x in rng.integers(37, 301, n_pre)]
    q_lens = [min(q, args.context) for q in q_lens] + [1] * (args.num_reqs - n_pre)
    mixed = Batch(args, q_lens, [args.context] * args.num_reqs, seed=2)
    fn = mixed.jaxkv_fn(scale, args.pages_per_chunk, args.query_tile)
    _, t_mixed, state = measure_donated(
        fn, mixed.jaxkv_state(), *mixed.jaxkv_args(), iters=iters_peer
    )
    results["mixed_jaxkv_ms"] = t_mixed * 1e3
    results["mixed_kv_bytes"] = mixed.kv_bytes
    results["mixed_path"] = _kernels(fn, mixed)
    line = f"mixed batch ({sum(q_lens)} tokens): jaxkv {t_mixed * 1e3:.2f} ms"
    peer = _try_ejkernel(mixed, scale, iters_peer)
    if not isinstance(peer, str):
        t_ej, want = peer
        got = np.asarray(state[1])
        diff = float(np.abs(got - want).max())
        # fp32: equal to rounding; bf16/fp16: ejkernel accumulates in the input
        # dtype, jaxkv in fp32.
        tol = 1e-4 if jnp.dtype(args.dtype) == jnp.float32 else 2e-2
        ok = bool(np.allclose(got, want, rtol=tol, atol=tol))
        results.update(
            mixed_ejkernel_ms=t_ej * 1e3,
            mixed_max_abs_diff=diff,
            mixed_matches_ejkernel=ok,
        )
        line += (
            f", ejkernel {t_ej * 1e3:.2f} ms; outputs equal within {tol:g}: {ok} "
            f"(max abs diff {diff:.2e})"
        )
    print(line)
    return results


def _typed_only(args: Any, scale: float) -> dict[str, Any]:
    """The typed-pool decode step alone, against a copy of its K/V bytes."""
    typed = Batch(
        args, [1] * args.num_reqs, [args.context] * args.num_reqs, storage="typed"
    )
    fn = typed.jaxkv_fn(scale, args.pages_per_chunk)
    compile_s, t_typed, _ = measure_donated(
        fn, typed.jaxkv_state(), *typed.jaxkv_args(), iters=args.iters
    )
    t_copy = _copy_time(typed.kv_bytes, args.iters)
    results = {
        "typed_ms": t_typed * 1e3,
        "copy_ms": t_copy * 1e3,
        "typed_over_copy": t_typed / t_copy,
        "kv_bytes": typed.kv_bytes,
        "typed_decode_path": _kernels(fn, typed),
        "compile_s": compile_s,
    }
    print_table(
        f"Paged decode attention, typed pool: {args.num_reqs} x {args.context}, "
        f"{args.num_heads}/{args.num_kv_heads} heads, head {args.head_dim}, page "
        f"{args.page}, {args.dtype} ({results['typed_decode_path']})",
        [
            {"impl": "copy of the KV bytes read", "ms": t_copy * 1e3},
            {
                "impl": "jaxkv write_kv + paged_attention, typed pool",
                "ms": t_typed * 1e3,
            },
        ],
    )
    return results


def _kernels(fn: Any, batch: Batch) -> str:
    """Which kernels a step ran, read off its lowered HLO."""
    hlo = fn.lower(batch.jaxkv_state(), *batch.jaxkv_args()).as_text()
    if "jaxkv_paged_decode" in hlo:
        return "native"
    if "triton" in hlo or "tpu_custom_call" in hlo:
        return "pallas"
    return "xla"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Paged attention through views vs ejkernel.")
    p.add_argument("--num-reqs", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    add_attention_shape_args(p)
    p.add_argument("--pages-per-chunk", type=int, default=4)
    p.add_argument("--query-tile", type=int, default=16, help="for the mixed batch")
    p.add_argument(
        "--typed-only",
        action="store_true",
        help="only the typed-pool decode step and the copy (gpu_check's extra shapes)",
    )
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = run(args)
    results["wall_s"] = time.perf_counter() - t0
    write_json(
        args.json,
        "bench_attention",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
