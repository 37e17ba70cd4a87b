"""Time to size the KV cache from memory at a 7B-like config (abstract weights).

A Llama-2-7B-like decoder (32 layers, 32 query / 8 KV heads of 128, bf16,
block 16, hidden 4096, MLP 11008, vocab 32000; 6.7e9 parameters as
``jax.ShapeDtypeStruct``s: nothing allocated) steps with ``lax.scan`` over
its layers in one stacked pool. ``jaxkv.size_kv_cache`` compiles the step at
two probe sizes and at its answer; this prints the time that takes (compiles
included), what it counted, and the blocks an 80 GiB x 0.9 budget gives beside
the weights, against the weights-only estimate (budget - weights) / block
bytes that ignores the step's activations and temporaries.

Then the time to grow: ``ServingLoop.resize`` moves every block in use to the
same id of the larger plan's pools (``jaxkv.serve._resize.move_blocks``) and
resizes the scheduler's allocator; this times both at the same config, from
``--grow-from`` blocks (three quarters in use) to twice as many, with real
pools (the first move includes its compile; the step programs' recompile for
the new pools is the sizing compile's cost again, per bucket).

    python benchmarks/bench_sizing.py [--layers 32] [--tokens 2048] [--grow-from 256]
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import parser, print_table, write_json  # noqa: E402

import jaxkv  # noqa: E402

HIDDEN, MLP, VOCAB, HEADS, KV_HEADS, HEAD = 4096, 11008, 32000, 32, 8, 128


def _config(args: Any) -> jaxkv.RunnerConfig:
    return jaxkv.llama_like_config(
        num_layers=args.layers,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD,
        block_size=16,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=args.tokens,
        token_buckets=(args.tokens,),
    )


def _weights(layers: int, hidden: int, mlp: int) -> dict[str, Any]:
    def w(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    return {
        "embed": w(VOCAB, hidden),
        "layers": {
            "q": w(layers, hidden, HEADS, HEAD),
            "k": w(layers, hidden, KV_HEADS, HEAD),
            "v": w(layers, hidden, KV_HEADS, HEAD),
            "o": w(layers, HEADS * HEAD, hidden),
            "up": w(layers, hidden, 2 * mlp),
            "down": w(layers, mlp, hidden),
        },
        "unembed": w(hidden, VOCAB),
    }


def _compile_step(args: Any, hidden: int, mlp: int):
    def compile_step(plan: Any) -> Any:
        names = [f"layers.{i}.self_attn" for i in range(args.layers)]
        builder = jaxkv.StepMetadataBuilder(plan, model_inputs=True)
        (inputs,) = builder.abstract_inputs()
        stack = plan.layer_stack(names)

        @functools.partial(jax.jit, donate_argnums=0)
        def step(pools, params, inputs):
            meta = builder.metadata(inputs)[names[0]]
            tokens, sample = builder.model_inputs_of(inputs)
            x = params["embed"][tokens]

            def body(carry, xs):
                x, pools = carry
                w, slot = xs
                q, k, v = (jnp.einsum("td,dhk->thk", x, w[n]) for n in "qkv")
                pools = jaxkv.write_kv(
                    pools, stack.layer, k, v, meta, layer=slot, implementation="xla"
                )
                a = jaxkv.paged_attention(
                    q, pools, stack.layer, meta, scale=HEAD**-0.5, layer=slot
                )
                x = x + a.reshape(x.shape[0], -1) @ w["o"]
                gate, up = jnp.split(x @ w["up"], 2, axis=-1)
                return (x + (jax.nn.silu(gate) * up) @ w["down"], pools), None

            (x, pools), _ = jax.lax.scan(
                body, (x, pools), (params["layers"], jnp.asarray(stack.slots))
            )
            return pools, x[sample] @ params["unembed"]

        pools = jax.eval_shape(plan.allocate)
        return step.lower(pools, _weights(args.layers, hidden, mlp), inputs).compile()

    return compile_step


def run(args: Any) -> dict[str, Any]:
    hidden, mlp = (HIDDEN, MLP) if not args.quick else (256, 512)
    cfg = _config(args)
    budget = int(args.memory_gib * 2**30 * 0.9)
    t0 = time.perf_counter()
    sizing = jaxkv.size_kv_cache(
        cfg,
        _compile_step(args, hidden, mlp),
        memory_bytes=budget,
        storage="stacked",
    )
    seconds = time.perf_counter() - t0
    weights = sum(
        x.size * x.dtype.itemsize
        for x in jax.tree.leaves(_weights(args.layers, hidden, mlp))
    )
    naive = (budget - weights) // sizing.pool_bytes_per_block
    print(sizing)
    rows = [
        {
            "layers": args.layers,
            "tokens": args.tokens,
            "size_s": seconds,
            "compiles": len(sizing.probes),
            "weights_GiB": weights / 2**30,
            "fixed_GiB": sizing.fixed_bytes / 2**30,
            "blocks": sizing.num_blocks,
            "weights_only_blocks": int(naive),
            "blocks_vs_weights_only": sizing.num_blocks / max(int(naive), 1),
        }
    ]
    print_table("size_kv_cache, 7B-like, abstract weights", rows)
    grow = _grow(cfg, args.grow_from)
    print_table("growing the cache: blocks in use moved to the larger pools", [grow])
    print(
        "target: none set (the times to size and to grow are reported); the "
        "blocks fit the budget by a compile at the answer"
    )
    return {"rows": rows, "grow": grow}


def _grow(cfg: jaxkv.RunnerConfig, blocks: int) -> dict[str, Any]:
    """Times moving 3/4 of `blocks` blocks into pools of twice as many."""
    from jaxkv.serve._resize import move_blocks

    small = jaxkv.make_plan(cfg, num_blocks=blocks, storage="stacked")
    big = jaxkv.make_plan(cfg, num_blocks=2 * blocks, storage="stacked")
    sched = jaxkv.Scheduler(small)
    ids = list(range(1, 1 + 3 * blocks // 4))
    sched.manager.allocator.allocate(len(ids))
    pools = jax.block_until_ready(small.allocate())
    times = []
    for _ in range(2):  # the first includes the move's compile
        target = jax.block_until_ready(big.allocate())
        t0 = time.perf_counter()
        jax.block_until_ready(move_blocks(small, pools, big, target, ids))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    sched.resize(big)
    host_s = time.perf_counter() - t0
    block_bytes = sum(p.size_bytes for p in small.pools) // blocks
    return {
        "from_blocks": blocks,
        "to_blocks": 2 * blocks,
        "moved_blocks": len(ids),
        "moved_MiB": len(ids) * block_bytes / 2**20,
        "first_move_s": times[0],
        "move_s": times[1],
        "scheduler_resize_ms": host_s * 1e3,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Time to size the KV cache from memory at a 7B-like config.")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--memory-gib", type=float, default=80.0)
    p.add_argument("--grow-from", type=int, default=256, help="blocks before growing")
    p.add_argument("--quick", action="store_true", help="small hidden and MLP")
    args = p.parse_args(argv)
    results = run(args)
    write_json(args.json, "bench_sizing", results)
    return results


if __name__ == "__main__":
    main()
