"""Steady decoding through ``jaxkv.ServingLoop`` against a dense-cache decode loop.

One small GQA decoder (``--layers`` attention layers, random weights), two
ways, same batch, same tokens, compilation excluded on both sides:

* **jaxkv**: ``ServingLoop`` (paged pools, Scheduler, one compiled program per
  bucket), with ``overlap=True`` (step N+1 scheduled, packed and dispatched
  while step N runs, decode tokens kept on the device) and ``overlap=False``
  (each step's tokens read before the next is scheduled); beside them the
  device time (the step's compiled program alone, back to back on the same
  inputs): wall minus device is the time the device waits on the host.
* **dense**: the same model with a dense ``(batch, max_len)`` KV cache per
  layer, every decode step inside one jitted ``lax.fori_loop`` (no host work
  at all): the floor.

Prints ms per decode step of each, the device-idle time per jaxkv step with
and without overlap, and jaxkv (overlap) / dense (target <= 1.5x at batch 16
with the host hidden).

    python benchmarks/bench_serve.py --batch 16 --prompt 32 --new 64
"""

from __future__ import annotations

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
    GQA_VOCAB,
    gqa_forward,
    gqa_params,
    parser,
    print_table,
    write_json,
)

import jaxkv  # noqa: E402
from jaxkv.step import decode_step_inputs  # noqa: E402

VOCAB = GQA_VOCAB


def run(args: Any) -> dict[str, Any]:
    heads, kv_heads, head = args.heads, args.kv_heads, args.head
    max_len = args.prompt + args.new
    cfg = jaxkv.pattern_config(
        "G",
        num_layers=args.layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head,
        block_size=16,
        max_model_len=max_len,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * args.prompt,
        token_buckets=(args.batch, args.batch * args.prompt),
    )
    plan = jaxkv.make_plan(cfg, num_blocks=args.batch * (-(-max_len // 16)) + 2)
    layers = [plan.attention_layer(layer.name) for layer in cfg.layers]
    params = gqa_params(args.layers, heads, kv_heads, head)
    scale = head**-0.5

    forward = gqa_forward(layers, scale)

    loop = jaxkv.ServingLoop(plan, forward, params)
    warm_s = loop.warm_up()
    # overlap=False: the prefill step is read back by its own step() call,
    # not by the first multi-step decode (which would count its wait).
    multi = jaxkv.ServingLoop(
        plan, forward, params, decode_steps=args.decode_steps, overlap=False
    )
    multi.warm_up()
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, VOCAB, (args.batch, args.prompt))

    def requests() -> list[jaxkv.Request]:
        return [
            jaxkv.Request(f"r{i}", prompt=p.tolist(), max_new_tokens=args.new)
            for i, p in enumerate(prompts)
        ]

    def decode_steps(overlap: bool) -> tuple[float, list[list[int]], int]:
        """Median wall time of a steady decode step, the outputs, compiles."""
        loop.overlap = overlap
        loop.reset()
        reqs = requests()
        for r in reqs:
            loop.submit(r)
        walls = []
        with jaxkv.count_compilations() as compiles:
            while loop.has_unfinished:
                running = loop.scheduler.running
                decode = bool(running) and not loop.scheduler.waiting
                decode = decode and all(
                    r.num_computed >= len(r.prompt) for r in running
                )
                t0 = time.perf_counter()
                loop.step()
                if decode:
                    walls.append(time.perf_counter() - t0)
        return statistics.median(walls), [r.output for r in reqs], len(compiles)

    def multi_steps() -> tuple[float, list[list[int]], int]:
        """Wall time per decode iteration of the multi-step loop: all its
        steady decode steps' wall time over the iterations they ran (a mean:
        every step counts).
        """  # noqa: D205
        multi.reset()
        reqs = requests()
        for r in reqs:
            multi.submit(r)
        total, iterations = 0.0, 0
        with jaxkv.count_compilations() as compiles:
            while multi.has_unfinished:
                before = multi.counters["decode_iterations"]
                t0 = time.perf_counter()
                multi.step()
                ran = multi.counters["decode_iterations"] - before
                if ran:
                    total += time.perf_counter() - t0
                    iterations += ran
        return total / max(iterations, 1), [r.output for r in reqs], len(compiles)

    # jaxkv, both ways; then the device time: one decode step's program alone,
    # back to back.
    wall_multi, outputs_multi, compiles_multi = multi_steps()
    wall_sync, outputs_sync, compiles_sync = decode_steps(False)
    wall, outputs, compiles = decode_steps(True)
    loop.reset()
    for r in requests():
        loop.submit(r)
    loop.overlap = False
    loop.step()  # the prefill
    scheduled = loop.scheduler.schedule()
    inputs = loop.builder.prepare(scheduled)
    seeds = np.zeros(inputs.layout.num_samples, np.int32)
    prev = jnp.zeros(loop.builder.max_num_samples, jnp.int32)
    pools = loop.pools
    pools, tok, _ = loop.programs(inputs.program, pools, params, inputs, seeds, prev)
    jax.block_until_ready(tok)  # warm-up, outside the samples
    samples = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        pools, tok, _ = loop.programs(
            inputs.program, pools, params, inputs, seeds, prev
        )
        jax.block_until_ready(tok)
        samples.append(time.perf_counter() - t0)
    loop.pools = pools
    device = statistics.median(samples)

    # The multi-step program alone, per iteration: one steady decode block of
    # `decode_steps` iterations, back to back on the same inputs.
    multi.reset()
    for r in requests():
        multi.submit(r)
    multi.step()  # the prefill
    block = multi.scheduler.schedule_decode(args.decode_steps)
    if block is None:
        raise RuntimeError("bench_serve: the batch is not in steady decoding")
    first = multi.builder.prepare(block)
    block_inputs = decode_step_inputs(
        first, num_reqs=block.num_reqs, step_slots=block.step_slots or []
    )
    seeds = np.zeros(first.layout.num_samples, np.int32)
    prev = jnp.zeros(multi.builder.max_num_samples, jnp.int32)
    key = ("decode", first.program)
    pools = multi.pools

    def block_call(pools: Any) -> Any:
        pools, tok, _ = multi.decode_programs(
            key, pools, params, block_inputs, seeds, prev
        )
        jax.block_until_ready(tok)
        return pools

    pools = block_call(pools)  # warm-up, outside the samples
    samples = []
    for _ in range(max(3, args.iters // args.decode_steps)):
        t0 = time.perf_counter()
        pools = block_call(pools)
        samples.append(time.perf_counter() - t0)
    multi.pools = pools
    multi_device = statistics.median(samples) / args.decode_steps

    # dense: the whole decode in one fori_loop.
    def layer_step(x, w, kc, vc, pos):
        q, k, v = (jnp.einsum("bd,dhk->bhk", x, w[n]) for n in ("wq", "wk", "wv"))
        kc = jax.lax.dynamic_update_slice_in_dim(kc, k[:, None], pos, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, v[:, None], pos, axis=1)
        g = heads // kv_heads
        qg = q.reshape(q.shape[0], kv_heads, g, head)
        s = jnp.einsum("bhgd,blhd->bhgl", qg, kc) * scale
        s = jnp.where(jnp.arange(max_len)[None, None, None] <= pos, s, -jnp.inf)
        out = jnp.einsum("bhgl,blhd->bhgd", jax.nn.softmax(s, axis=-1), vc)
        return x + out.reshape(x.shape[0], -1) @ w["wo"], kc, vc

    def prefill(params, prompt):
        caches = []
        x = params["embed"][prompt]  # (B, P, D)
        p = prompt.shape[1]
        causal = jnp.arange(p)[:, None] >= jnp.arange(p)[None]
        for w in params["layers"]:
            q, k, v = (jnp.einsum("bpd,dhk->bphk", x, w[n]) for n in ("wq", "wk", "wv"))
            kr, vr = (
                jnp.repeat(k, heads // kv_heads, 2),
                jnp.repeat(v, heads // kv_heads, 2),
            )
            s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) * scale
            s = jnp.where(causal[None, None], s, -jnp.inf)
            out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vr)
            x = x + out.reshape(x.shape[0], p, -1) @ w["wo"]
            pad = ((0, 0), (0, max_len - p), (0, 0), (0, 0))
            caches.append((jnp.pad(k, pad), jnp.pad(v, pad)))
        return jnp.argmax(x[:, -1] @ params["unembed"], -1), caches

    @jax.jit
    def dense_decode(params, token, caches):
        def body(i, carry):
            token, caches, out = carry
            x = params["embed"][token]
            new = []
            for w, (kc, vc) in zip(params["layers"], caches, strict=True):
                x, kc, vc = layer_step(x, w, kc, vc, args.prompt + i)
                new.append((kc, vc))
            token = jnp.argmax(x @ params["unembed"], -1).astype(jnp.int32)
            return token, new, out.at[:, i].set(token)

        out = jnp.zeros((token.shape[0], args.new - 1), jnp.int32)
        return jax.lax.fori_loop(0, args.new - 1, body, (token, caches, out))[2]

    first, caches = jax.jit(prefill)(params, jnp.asarray(prompts))
    first = first.astype(jnp.int32)
    compiled = dense_decode.lower(params, first, caches).compile()
    dense_out = np.asarray(compiled(params, first, caches))
    times = []
    for _ in range(max(3, args.iters // 10)):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, first, caches))
        times.append(time.perf_counter() - t0)
    dense = statistics.median(times) / (args.new - 1)
    same = [o[1:] for o in outputs] == dense_out.tolist() and [
        o[0] for o in outputs
    ] == np.asarray(first).tolist()

    same = same and outputs == outputs_sync == outputs_multi
    compiles += compiles_multi
    rows = [
        {
            "path": f"jaxkv ServingLoop, decode_steps={args.decode_steps} "
            "(multi-step), per iteration",
            "ms/step": wall_multi * 1e3,
            "device idle ms": max(0.0, wall_multi - multi_device) * 1e3,
            "tokens/s": args.batch / wall_multi,
        },
        {
            "path": "  the multi-step program alone (device), per iteration",
            "ms/step": multi_device * 1e3,
            "device idle ms": 0.0,
            "tokens/s": args.batch / multi_device,
        },
        {
            "path": "jaxkv ServingLoop, overlap (host hidden), decode step",
            "ms/step": wall * 1e3,
            "device idle ms": max(0.0, wall - device) * 1e3,
            "tokens/s": args.batch / wall,
        },
        {
            "path": "jaxkv ServingLoop, no overlap, decode step",
            "ms/step": wall_sync * 1e3,
            "device idle ms": max(0.0, wall_sync - device) * 1e3,
            "tokens/s": args.batch / wall_sync,
        },
        {
            "path": "  the step program alone (device)",
            "ms/step": device * 1e3,
            "device idle ms": 0.0,
            "tokens/s": args.batch / device,
        },
        {
            "path": "dense cache, lax.fori_loop",
            "ms/step": dense * 1e3,
            "device idle ms": 0.0,
            "tokens/s": args.batch / dense,
        },
    ]
    print_table(
        f"Decode, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.layers} layers {heads}/{kv_heads} heads x {head}; "
        f"{len(loop.programs)} programs warmed up in {warm_s:.1f} s",
        rows,
    )
    print(
        f"\njaxkv multi-step (decode_steps={args.decode_steps}) / dense: "
        f"{wall_multi / dense:.2f}x per decode step (target <= 1.5x), device idle "
        f"{max(0.0, wall_multi - multi_device) * 1e3:.3f} ms an iteration; "
        f"overlap / dense: {wall / dense:.2f}x; no overlap / dense: "
        f"{wall_sync / dense:.2f}x; device idle per "
        f"step {max(0.0, wall - device) * 1e3:.3f} ms with overlap vs "
        f"{max(0.0, wall_sync - device) * 1e3:.3f} ms without; device program / "
        f"dense: {device / dense:.2f}x; same tokens (dense, both loops): {same}; "
        f"compiles while serving: {compiles + compiles_sync}"
    )
    return {
        "multi_ms": wall_multi * 1e3,
        "multi_over_dense": wall_multi / dense,
        "multi_device_ms": multi_device * 1e3,
        "multi_idle_ms": max(0.0, wall_multi - multi_device) * 1e3,
        "wall_ms": wall * 1e3,
        "wall_no_overlap_ms": wall_sync * 1e3,
        "device_ms": device * 1e3,
        "idle_ms": max(0.0, wall - device) * 1e3,
        "idle_no_overlap_ms": max(0.0, wall_sync - device) * 1e3,
        "dense_ms": dense * 1e3,
        "jaxkv_over_dense": wall / dense,
        "no_overlap_over_dense": wall_sync / dense,
        "device_over_dense": device / dense,
        "same_tokens": same,
        "compiles": compiles + compiles_sync,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser("Steady decoding through ServingLoop vs a dense-cache decode loop.")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=16)
    args = p.parse_args(argv)
    results = run(args)
    write_json(
        args.json,
        "bench_serve",
        {"args": vars(args) | {"json": None}, "results": results},
    )
    return results


if __name__ == "__main__":
    main()
