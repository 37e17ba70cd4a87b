"""Compile time of a deep model stepping with `lax.scan` over its layers.

A Llama-like decoder (GQA 8/2 heads, head 64, page 16, fp32) whose layers live
in one stacked typed pool (`make_plan(storage="stacked")`): the jitted step
builds the group's metadata once, then scans over the layers, each writing its
K/V and attending with `layer=` traced. Compiled for 32 and for 2 layers side
by side in one run (target: 32 layers within 1.5x the 2-layer time), and, for
contrast, the 32 layers unrolled (a Python loop, one view per layer). The
scanned and unrolled steps give the same logits (checked here on one step;
`tests/test_typed_pools.py` checks a whole serve loop).

    python benchmarks/bench_layer_scan.py
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    default_implementation,
    parser,
    print_table,
    write_json,
)

import jaxkv  # noqa: E402

IMPLEMENTATION = default_implementation()


def _model(num_layers: int, hidden: int, vocab: int, seed: int = 0) -> dict:
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    return {
        "embed": jax.random.normal(next(keys), (vocab, hidden)),
        "layers": {
            n: jax.random.normal(next(keys), (num_layers, hidden, h, 64)) / 16
            for n, h in zip("qkv", (8, 2, 2), strict=True)
        },
        "unembed": jax.random.normal(next(keys), (hidden, vocab)),
    }


def _step_fn(plan: Any, builder: Any, num_layers: int, scan: bool) -> Any:
    names = [f"layers.{i}.self_attn" for i in range(num_layers)]

    def layer_step(x, pools, w, layer, slot, meta):
        q, k, v = (jnp.einsum("td,dhk->thk", x, w[n]) for n in "qkv")
        pools = jaxkv.write_kv(
            pools,
            layer.view,
            k,
            v,
            meta.slot_mapping,
            layer=slot,
            implementation=IMPLEMENTATION,
        )
        out = jaxkv.paged_attention(
            q,
            pools,
            layer,
            meta,
            scale=0.125,
            layer=slot,
            # The C++ decode kernel takes rows of one token only.
            implementation="xla"
            if IMPLEMENTATION == "native" and q.shape[0] > meta.max_reqs
            else IMPLEMENTATION,
        )
        return x + out.reshape(x.shape), pools

    @functools.partial(jax.jit, donate_argnums=0)
    def step(pools, params, inputs):
        meta = builder.metadata(inputs)[names[0]]  # one group: built once
        tokens, sample = builder.model_inputs_of(inputs)
        x = params["embed"][tokens]
        if scan:
            stack = plan.layer_stack(names)

            def body(carry, xs):
                x, pools = carry
                w, slot = xs
                return layer_step(x, pools, w, stack.layer, slot, meta), None

            (x, pools), _ = jax.lax.scan(
                body, (x, pools), (params["layers"], jnp.asarray(stack.slots))
            )
        else:
            for i, name in enumerate(names):
                w = jax.tree.map(lambda a, i=i: a[i], params["layers"])
                layer = plan.attention_layer(name)
                x, pools = layer_step(x, pools, w, layer, None, meta)
        return pools, x[sample] @ params["unembed"]

    return step


def _compile(num_layers: int, scan: bool, args: Any) -> dict[str, Any]:
    cfg = jaxkv.llama_like_config(
        num_layers=num_layers,
        num_kv_heads=2,
        head_size=64,
        num_heads=8,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=args.tokens,
        token_buckets=(args.tokens,),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=64, storage="stacked")
    builder = jaxkv.StepMetadataBuilder(plan, model_inputs=True)
    sched = jaxkv.Scheduler(plan)
    for i in range(4):
        sched.add_request(
            jaxkv.Request(f"r{i}", prompt=list(range(i, i + 20)), max_new_tokens=2)
        )
    scheduled = sched.schedule()
    inputs = builder.prepare(scheduled)
    params = _model(num_layers, 512, 64)
    step = _step_fn(plan, builder, num_layers, scan)
    pools = plan.allocate()
    t0 = time.perf_counter()
    compiled = step.lower(pools, params, inputs).compile()
    seconds = time.perf_counter() - t0
    _, logits = compiled(pools, params, inputs)
    return {"compile_s": seconds, "logits": np.asarray(logits)}


def run(args: Any) -> dict[str, Any]:
    deep, shallow = args.layers, 2
    scanned = _compile(deep, True, args)
    small = _compile(shallow, True, args)
    unrolled = _compile(deep, False, args)
    ratio = scanned["compile_s"] / small["compile_s"]
    same = bool(
        np.allclose(scanned["logits"], unrolled["logits"], rtol=1e-4, atol=1e-4)
    )
    rows = [
        {"model": f"{shallow} layers, scan", "compile s": small["compile_s"]},
        {"model": f"{deep} layers, scan", "compile s": scanned["compile_s"]},
        {"model": f"{deep} layers, unrolled", "compile s": unrolled["compile_s"]},
    ]
    print_table(f"Compile time of one step ({args.tokens}-token bucket)", rows)
    print(
        f"\n{deep} layers / {shallow} layers, scanned: {ratio:.2f}x (target <= 1.5x);"
        f" unrolled / scanned at {deep} layers: "
        f"{unrolled['compile_s'] / scanned['compile_s']:.1f}x; scanned logits equal "
        f"unrolled: {same}"
    )
    return {
        "scan_deep_s": scanned["compile_s"],
        "scan_shallow_s": small["compile_s"],
        "unrolled_deep_s": unrolled["compile_s"],
        "deep_over_shallow": ratio,
        "scan_equals_unrolled": same,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Compile time of a layer scan over a stacked pool.")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_layer_scan",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
